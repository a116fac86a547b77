//! The router owns its background tasks: stopping it ends the decode worker's watch and the
//! file-reload task, and its task ends only after they have (nothing is left detached).

use crate::support;

use support::{scratch, worker, Router};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_router_ends_its_background_tasks() {
    let Some(model) = support::model() else {
        return;
    };
    let dir = scratch("shutdown");
    let keys = dir.join("keys");
    std::fs::write(&keys, "sk-a\n").unwrap();
    let (decode, _gate) = worker(true).await;
    let keys_flag = keys.display().to_string();
    let mut router = Router::start(&model, &decode, &["--api-keys-file", &keys_flag]).await;
    // The decode worker's watch and the reload task.
    assert_eq!(router.running.cluster.background_tasks(), 2);

    router.shutdown.cancel();
    tokio::time::timeout(support::PATIENCE, &mut router.running.task)
        .await
        .expect("the router stops")
        .expect("its task does not panic")
        .expect("it stops cleanly");
    assert_eq!(router.running.cluster.background_tasks(), 0);
}
