use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::*;

fn keys(text: &str) -> Keys {
    Keys::from_text(Path::new("keys.txt"), text, None).expect("keys parse")
}

fn parse_err(text: &str) -> String {
    Keys::from_text(Path::new("keys.txt"), text, None)
        .expect_err("the file is refused")
        .to_string()
}

#[test]
fn bare_keys_are_the_old_format_and_have_no_limits() {
    let k = keys("sk-one\n\n  sk-two  \n# sk-commented\n");
    assert_eq!(k.len(), 2);
    let one = k.find("sk-one").expect("first key");
    assert_eq!(one.limits(), KeyLimits::default());
    assert!(k.find("sk-two").is_some(), "surrounding blanks are trimmed");
    assert!(k.find("sk-commented").is_none());
    assert!(k.find("sk-on").is_none() && k.find("").is_none());
    assert!(one.label().starts_with("key-") && !one.label().contains("sk-one"));
}

#[test]
fn fields_set_limits_and_name() {
    let k = keys("sk-a rpm=60 tpm=1000\tconcurrency=2 name=team-a\n");
    let a = k.find("sk-a").unwrap();
    assert_eq!(
        a.limits(),
        KeyLimits {
            requests_per_minute: Some(60),
            tokens_per_minute: Some(1000),
            concurrency: Some(2),
        }
    );
    assert_eq!(a.label(), "team-a");
}

#[test]
fn bad_lines_name_the_line_and_never_the_key() {
    let e = parse_err("sk-ok\nsk-secret rpm=0\n");
    assert!(e.contains("keys.txt:2") && e.contains("rpm"), "{e}");
    assert!(!e.contains("sk-secret"), "{e}");
    assert!(parse_err("sk-a burst=3").contains("unknown field `burst`"));
    assert!(parse_err("sk-a rpm").contains("rpm=N"));
    assert!(parse_err("sk-a tpm=ten").contains("`tpm`"));
    assert!(parse_err("rpm=3").contains("start with the key"));
    assert!(parse_err("sk-a name=a/b").contains("`name`"));
    assert!(parse_err("sk-a\nsk-a\n").contains("already on line 1"));
    assert!(parse_err("# only a comment\n\n").contains("holds no API keys"));
}

#[tokio::test(start_paused = true)]
async fn requests_per_minute_refill_continuously() {
    let k = keys("sk rpm=2");
    let e = k.find("sk").unwrap();
    let first = e.admit().expect("1st");
    assert_eq!(first.status().requests.unwrap().remaining, 1);
    let _second = e.admit().expect("2nd");
    let refused = e.admit().expect_err("3rd is over the limit");
    assert_eq!(refused.kind, LimitKind::Requests);
    // 2 per minute: one request back every 30 s.
    assert_eq!(refused.retry_after, Duration::from_secs(30));
    assert_eq!(refused.retry_after_secs(), 30);
    let s = refused.status.requests.unwrap();
    assert_eq!((s.limit, s.remaining), (2, 0));
    assert_eq!(s.reset, Duration::from_secs(60));
    tokio::time::advance(Duration::from_secs(29)).await;
    assert!(e.admit().is_err());
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(e.admit().is_ok());
}

#[tokio::test(start_paused = true)]
async fn concurrency_cap_frees_on_drop() {
    let k = keys("sk concurrency=1");
    let e = k.find("sk").unwrap();
    let held = e.admit().unwrap();
    assert_eq!(e.admit().unwrap_err().kind, LimitKind::Concurrency);
    drop(held);
    assert!(e.admit().is_ok());
}

#[tokio::test(start_paused = true)]
async fn tokens_are_reserved_then_settled() {
    let k = keys("sk tpm=100");
    let e = k.find("sk").unwrap();
    let mut a = e.admit().unwrap();
    a.reserve_tokens(80).unwrap();
    assert_eq!(a.status().tokens.unwrap().remaining, 20);
    let mut b = e.admit().unwrap();
    let refused = b.reserve_tokens(30).expect_err("only 20 left");
    assert_eq!(refused.kind, LimitKind::Tokens);
    // 100 per minute: 10 more tokens take 6 s.
    assert_eq!(refused.retry_after, Duration::from_secs(6));
    // The request used 30 of its 80: 50 go back.
    a.settle(30);
    b.reserve_tokens(30).expect("70 left after settling");
    assert_eq!(b.status().tokens.unwrap().remaining, 40);
    let too_big = e.admit().unwrap().reserve_tokens(101).unwrap_err();
    assert!(too_big.message.contains("too large"), "{}", too_big.message);
}

#[tokio::test(start_paused = true)]
async fn a_refused_token_reservation_gives_its_request_back() {
    let k = keys("sk rpm=1 tpm=10");
    let e = k.find("sk").unwrap();
    let mut l = e.admit().unwrap();
    assert!(l.reserve_tokens(11).is_err());
    drop(l);
    assert!(
        e.admit().is_ok(),
        "the refused request did not use the rpm budget"
    );
}

#[tokio::test(start_paused = true)]
async fn one_keys_limit_leaves_others_alone() {
    let k = keys("sk-a rpm=1\nsk-b rpm=1");
    let a = k.find("sk-a").unwrap();
    let _ = a.admit().unwrap();
    assert!(a.admit().is_err());
    assert!(k.find("sk-b").unwrap().admit().is_ok());
}

#[tokio::test(start_paused = true)]
async fn reload_keeps_the_window_and_applies_new_limits() {
    let dir = std::env::temp_dir().join(format!("cleave-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("keys");
    std::fs::write(&path, "sk rpm=2\nsk-gone\n").unwrap();
    let k = Keys::load(&path, None).unwrap();
    let e = k.find("sk").unwrap();
    let held = e.admit().unwrap();
    assert!(!k.reload().unwrap(), "unchanged file");
    std::fs::write(&path, "sk rpm=3 concurrency=1\n").unwrap();
    assert!(k.reload().unwrap());
    assert!(k.find("sk-gone").is_none());
    let same = k.find("sk").unwrap();
    assert!(Arc::ptr_eq(&e, &same), "a key that stays keeps its state");
    // One of three used, and the request in flight still counts for the new cap.
    assert_eq!(same.admit().unwrap_err().kind, LimitKind::Concurrency);
    drop(held);
    let l = same.admit().unwrap();
    assert_eq!(l.status().requests.unwrap().remaining, 1);
    // A broken file keeps the previous keys.
    std::fs::write(&path, "sk rpm=-1\n").unwrap();
    assert!(k.reload().is_err());
    assert!(k.find("sk").is_some());
    assert!(!k.reload().unwrap(), "reported once");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn headers_follow_openai() {
    let status = RateStatus {
        requests: Some(BucketStatus {
            limit: 60,
            remaining: 59,
            reset: Duration::from_secs(1),
        }),
        tokens: Some(BucketStatus {
            limit: 150000,
            remaining: 149984,
            reset: Duration::from_secs(360),
        }),
    };
    let mut h = HeaderMap::new();
    status.apply(&mut h);
    assert_eq!(h["x-ratelimit-limit-requests"], "60");
    assert_eq!(h["x-ratelimit-remaining-requests"], "59");
    assert_eq!(h["x-ratelimit-reset-requests"], "1s");
    assert_eq!(h["x-ratelimit-remaining-tokens"], "149984");
    assert_eq!(h["x-ratelimit-reset-tokens"], "6m0s");
    assert_eq!(openai_duration(Duration::from_millis(17)), "17ms");
    assert_eq!(openai_duration(Duration::from_millis(1500)), "1.5s");
    assert_eq!(openai_duration(Duration::from_millis(61250)), "1m1.25s");
    let mut none = HeaderMap::new();
    RateStatus::default().apply(&mut none);
    assert!(none.is_empty());
}
