//! Why an InferenceService's pods are not running, read from their status, pure: the image
//! cannot be pulled, a container crashes (with the last lines of its log: containers use
//! `terminationMessagePolicy: FallbackToLogsOnError`), is OOM-killed, or the pod cannot be
//! scheduled. The status conditions name the first problem, so `kubectl get isvc -o wide` and
//! `kubectl describe isvc` say what is wrong without reading pod events.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

/// What kind of failure; sets the condition's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    /// `ErrImagePull`, `ImagePullBackOff`, `InvalidImageName`.
    ImagePull,
    /// The container's last run ended OOM-killed.
    OomKilled,
    /// It exits with an error (`CrashLoopBackOff`, an init container that failed, a
    /// configuration the runtime refused).
    Crash,
    /// The scheduler found no node.
    Unschedulable,
}

impl ProblemKind {
    /// The condition reason.
    pub fn reason(self) -> &'static str {
        match self {
            ProblemKind::ImagePull => "ImagePullFailed",
            ProblemKind::OomKilled => "OOMKilled",
            ProblemKind::Crash => "ContainerFailing",
            ProblemKind::Unschedulable => "Unschedulable",
        }
    }
}

/// One pod's problem, with a message naming the pod and container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The kind.
    pub kind: ProblemKind,
    /// `pod P container C: …`.
    pub message: String,
}

/// Longest piece of a termination message (a log tail) quoted in a condition.
const MAX_LOG: usize = 400;

fn tail(s: &str) -> String {
    let s = s.trim();
    if s.len() <= MAX_LOG {
        return s.to_string();
    }
    let mut start = s.len() - MAX_LOG;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &s[start..])
}

fn container(pod: &str, c: &ContainerStatus) -> Option<Problem> {
    let state = c.state.as_ref()?;
    let at = |kind, what: String| Problem {
        kind,
        message: format!("pod {pod} container {}: {what}", c.name),
    };
    if let Some(w) = &state.waiting {
        let reason = w.reason.as_deref().unwrap_or_default();
        let message = w.message.as_deref().unwrap_or_default();
        match reason {
            "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull" => {
                return Some(at(ProblemKind::ImagePull, format!("{reason}: {message}")));
            }
            "CreateContainerConfigError" | "CreateContainerError" | "RunContainerError" => {
                return Some(at(ProblemKind::Crash, format!("{reason}: {message}")));
            }
            _ => {}
        }
    }
    // A crash loop shows the last run in lastState; an init container that just failed shows
    // it in state.
    let ended = state
        .terminated
        .as_ref()
        .or_else(|| c.last_state.as_ref()?.terminated.as_ref())?;
    if ended.exit_code == 0 {
        return None;
    }
    let reason = ended.reason.as_deref().unwrap_or("Error");
    let kind = if reason == "OOMKilled" {
        ProblemKind::OomKilled
    } else {
        ProblemKind::Crash
    };
    let log = ended.message.as_deref().map(tail).unwrap_or_default();
    let restarts = if c.restart_count > 0 {
        format!(", {} restarts", c.restart_count)
    } else {
        String::new()
    };
    let mut what = format!("{reason} (exit code {}{restarts})", ended.exit_code);
    if !log.is_empty() {
        what.push_str(": ");
        what.push_str(&log);
    }
    Some(at(kind, what))
}

/// The problems of one pod (none when it runs or is only starting).
pub fn of_pod(pod: &Pod) -> Vec<Problem> {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    if let Some(c) = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    }) {
        return vec![Problem {
            kind: ProblemKind::Unschedulable,
            message: format!(
                "pod {name}: unschedulable: {}",
                c.message.as_deref().unwrap_or_default()
            ),
        }];
    }
    let init = status.init_container_statuses.iter().flatten();
    let main = status.container_statuses.iter().flatten();
    init.chain(main)
        .filter(|c| !c.ready)
        .filter_map(|c| container(name, c))
        .collect()
}

/// The problems of a set of pods, at most `limit`, one per distinct (kind, container message
/// without the pod name) so that N replicas failing alike are reported once.
pub fn of_pods<'a>(pods: impl IntoIterator<Item = &'a Pod>, limit: usize) -> Vec<Problem> {
    let mut out: Vec<Problem> = Vec::new();
    let mut seen = Vec::new();
    for p in pods {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        for problem in of_pod(p) {
            let name = p.metadata.name.as_deref().unwrap_or("?");
            let key = (problem.kind, problem.message.replacen(name, "", 1));
            if !seen.contains(&key) && out.len() < limit {
                seen.push(key);
                out.push(problem);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, PodCondition, PodStatus,
    };

    fn pod(name: &str, status: PodStatus) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.status = Some(status);
        p
    }

    fn waiting(name: &str, reason: &str, message: &str) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn crashed(reason: &str, code: i32, log: &str) -> ContainerStatus {
        ContainerStatus {
            name: "worker".into(),
            restart_count: 3,
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("CrashLoopBackOff".into()),
                    message: Some("back-off 40s restarting failed container".into()),
                }),
                ..Default::default()
            }),
            last_state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: code,
                    reason: Some(reason.into()),
                    message: Some(log.into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn an_image_that_cannot_be_pulled_is_named() {
        let p = pod(
            "m-decode-1",
            PodStatus {
                container_statuses: Some(vec![waiting(
                    "worker",
                    "ErrImagePull",
                    "pull access denied for localhost/nope:1",
                )]),
                ..Default::default()
            },
        );
        let got = of_pod(&p);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].kind, ProblemKind::ImagePull);
        assert!(got[0].message.contains(
            "m-decode-1 container worker: ErrImagePull: pull access denied for localhost/nope:1"
        ));
    }

    #[test]
    fn a_crash_quotes_the_log_tail_and_oom_is_its_own_reason() {
        let long = format!(
            "{}model file /models/x.gguf: No such file",
            "x".repeat(1000)
        );
        let p = pod(
            "m-prefill-0",
            PodStatus {
                container_statuses: Some(vec![crashed("Error", 1, &long)]),
                ..Default::default()
            },
        );
        let got = of_pod(&p);
        assert_eq!(got[0].kind, ProblemKind::Crash);
        assert!(got[0]
            .message
            .ends_with("model file /models/x.gguf: No such file"));
        assert!(got[0].message.contains("Error (exit code 1, 3 restarts)"));
        assert!(got[0].message.len() < 600);

        let p = pod(
            "m-decode-0",
            PodStatus {
                container_statuses: Some(vec![crashed("OOMKilled", 137, "")]),
                ..Default::default()
            },
        );
        assert_eq!(of_pod(&p)[0].kind, ProblemKind::OomKilled);
        assert_eq!(ProblemKind::OomKilled.reason(), "OOMKilled");
    }

    #[test]
    fn running_starting_and_unschedulable_pods() {
        let running = ContainerStatus {
            name: "worker".into(),
            ready: true,
            ..Default::default()
        };
        let ok = pod(
            "a",
            PodStatus {
                container_statuses: Some(vec![running, waiting("w2", "ContainerCreating", "")]),
                ..Default::default()
            },
        );
        assert!(of_pod(&ok).is_empty());
        let pending = pod(
            "b",
            PodStatus {
                conditions: Some(vec![PodCondition {
                    type_: "PodScheduled".into(),
                    status: "False".into(),
                    reason: Some("Unschedulable".into()),
                    message: Some("0/1 nodes are available: 1 Insufficient cpu.".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            },
        );
        let got = of_pod(&pending);
        assert_eq!(got[0].kind, ProblemKind::Unschedulable);
        assert!(got[0].message.contains("Insufficient cpu"));
    }

    #[test]
    fn replicas_failing_alike_are_reported_once() {
        let pods: Vec<Pod> = (0..3)
            .map(|i| {
                pod(
                    &format!("m-decode-{i}"),
                    PodStatus {
                        container_statuses: Some(vec![waiting("worker", "ImagePullBackOff", "no")]),
                        ..Default::default()
                    },
                )
            })
            .collect();
        assert_eq!(of_pods(&pods, 3).len(), 1);
    }
}
