//! How a pod gets the model file: a volume at /models, filled by an init container for URL and
//! image sources.

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, HostPathVolumeSource,
    PersistentVolumeClaimVolumeSource, SecurityContext, Volume, VolumeMount,
};

use super::RenderError;
use crate::crd::ModelSource;

/// Where the model volume is mounted in every container.
pub const MODEL_DIR: &str = "/models";

/// Where the init container that fills the volume mounts it: not [`MODEL_DIR`], which would
/// hide a model image's own `/models` (the Dockerfile's `model` stage puts the GGUF there).
pub const FILL_DIR: &str = "/cleave-model";

/// The volume, its mount, an optional init container, and the model's path in the container.
#[derive(Clone, Debug)]
pub struct ModelMount {
    /// The `model` volume.
    pub volume: Volume,
    /// Its read-only mount for the main container.
    pub mount: VolumeMount,
    /// Fills the volume (URL and image sources).
    pub init: Option<Container>,
    /// `CLEAVE_MODEL`.
    pub model_path: String,
}

/// Last path segment of a URL or path, without query or fragment.
pub fn file_name(s: &str) -> String {
    let s = s.split(['?', '#']).next().unwrap_or(s);
    let name = s.rsplit('/').next().unwrap_or(s);
    if name.is_empty() {
        "model.gguf".into()
    } else {
        name.to_string()
    }
}

fn restricted() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        ..Default::default()
    }
}

/// The model volume for a source; `Err` names what is wrong (exactly one source must be set).
pub fn model_mount(source: &ModelSource, fetch_image: &str) -> Result<ModelMount, RenderError> {
    let set = [
        source.path.is_some(),
        source.url.is_some(),
        source.image.is_some(),
    ];
    if set.iter().filter(|s| **s).count() != 1 {
        return Err(RenderError::ModelSourceCount);
    }
    let mount = VolumeMount {
        name: "model".into(),
        mount_path: MODEL_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    };
    let writable = VolumeMount {
        name: "model".into(),
        mount_path: FILL_DIR.into(),
        ..Default::default()
    };
    let empty = Volume {
        name: "model".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    };
    if let Some(p) = &source.path {
        return Ok(match &p.claim_name {
            Some(claim) => {
                let rel = p.path.trim_start_matches('/');
                if rel.split('/').any(|c| c == "..") {
                    return Err(RenderError::PathLeavesClaim(p.path.clone()));
                }
                ModelMount {
                    volume: Volume {
                        name: "model".into(),
                        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                            claim_name: claim.clone(),
                            read_only: Some(true),
                        }),
                        ..Default::default()
                    },
                    mount,
                    init: None,
                    model_path: format!("{MODEL_DIR}/{rel}"),
                }
            }
            None => {
                if !p.path.starts_with('/') {
                    return Err(RenderError::RelativeHostPath(p.path.clone()));
                }
                let (dir, file) = p.path.rsplit_once('/').unwrap_or(("", &p.path));
                ModelMount {
                    volume: Volume {
                        name: "model".into(),
                        host_path: Some(HostPathVolumeSource {
                            path: if dir.is_empty() {
                                "/".into()
                            } else {
                                dir.into()
                            },
                            type_: Some("Directory".into()),
                        }),
                        ..Default::default()
                    },
                    mount,
                    init: None,
                    model_path: format!("{MODEL_DIR}/{file}"),
                }
            }
        });
    }
    if let Some(u) = &source.url {
        let file = file_name(&u.url);
        let dest = format!("{FILL_DIR}/{file}");
        let check = match &u.sha256 {
            Some(sum) => format!(" && echo \"{sum}  $DEST.part\" | sha256sum -c -"),
            None => String::new(),
        };
        let script = format!(
            "set -e; [ -s \"$DEST\" ] && exit 0; curl -fSL --retry 5 -o \"$DEST.part\" \"$URL\"{check} && mv \"$DEST.part\" \"$DEST\""
        );
        let init = Container {
            name: "fetch-model".into(),
            image: Some(fetch_image.into()),
            command: Some(vec!["sh".into(), "-c".into(), script]),
            env: Some(vec![
                EnvVar {
                    name: "URL".into(),
                    value: Some(u.url.clone()),
                    ..Default::default()
                },
                EnvVar {
                    name: "DEST".into(),
                    value: Some(dest),
                    ..Default::default()
                },
            ]),
            volume_mounts: Some(vec![writable]),
            security_context: Some(restricted()),
            ..Default::default()
        };
        return Ok(ModelMount {
            volume: empty,
            mount,
            init: Some(init),
            model_path: format!("{MODEL_DIR}/{file}"),
        });
    }
    let i = source.image.as_ref().expect("one source is set");
    let file = file_name(&i.path);
    let init = Container {
        name: "copy-model".into(),
        image: Some(i.image.clone()),
        command: Some(vec![
            "cp".into(),
            i.path.clone(),
            format!("{FILL_DIR}/{file}"),
        ]),
        volume_mounts: Some(vec![writable]),
        security_context: Some(restricted()),
        ..Default::default()
    };
    Ok(ModelMount {
        volume: empty,
        mount,
        init: Some(init),
        model_path: format!("{MODEL_DIR}/{file}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ImageSource, PathSource, UrlSource};

    #[test]
    fn sources_mount_where_the_model_path_points() {
        let pvc = ModelSource {
            path: Some(PathSource {
                claim_name: Some("weights".into()),
                path: "llama/q4.gguf".into(),
            }),
            ..Default::default()
        };
        let m = model_mount(&pvc, "curl").unwrap();
        assert_eq!(m.model_path, "/models/llama/q4.gguf");
        assert!(m.init.is_none());
        assert_eq!(m.mount.read_only, Some(true));

        let url = ModelSource {
            url: Some(UrlSource {
                url: "https://h.example/a/b/m.gguf?download=1".into(),
                sha256: Some("ab".repeat(32)),
            }),
            ..Default::default()
        };
        let m = model_mount(&url, "curlimages/curl:8").unwrap();
        assert_eq!(m.model_path, "/models/m.gguf");
        let init = m.init.unwrap();
        assert_eq!(init.image.as_deref(), Some("curlimages/curl:8"));
        assert!(init.command.unwrap()[2].contains("sha256sum -c"));

        let img = ModelSource {
            image: Some(ImageSource {
                image: "models:1".into(),
                path: "/m/x.gguf".into(),
            }),
            ..Default::default()
        };
        let m = model_mount(&img, "curl").unwrap();
        assert_eq!(m.model_path, "/models/x.gguf");
        let init = m.init.unwrap();
        assert_eq!(init.image.as_deref(), Some("models:1"));
        // The image's own /models must stay visible to the copy.
        assert_eq!(
            init.command.unwrap(),
            ["cp", "/m/x.gguf", "/cleave-model/x.gguf"]
        );
        assert_eq!(init.volume_mounts.unwrap()[0].mount_path, FILL_DIR);
    }

    #[test]
    fn zero_or_two_sources_or_escaping_paths_are_errors() {
        assert!(matches!(
            model_mount(&ModelSource::default(), "c"),
            Err(RenderError::ModelSourceCount)
        ));
        let both = ModelSource {
            path: Some(PathSource {
                claim_name: None,
                path: "/a/b.gguf".into(),
            }),
            url: Some(UrlSource {
                url: "http://x/y".into(),
                sha256: None,
            }),
            ..Default::default()
        };
        assert!(matches!(
            model_mount(&both, "c"),
            Err(RenderError::ModelSourceCount)
        ));
        let escape = ModelSource {
            path: Some(PathSource {
                claim_name: Some("c".into()),
                path: "../etc/passwd".into(),
            }),
            ..Default::default()
        };
        assert!(matches!(
            model_mount(&escape, "c"),
            Err(RenderError::PathLeavesClaim(_))
        ));
        let relative = ModelSource {
            path: Some(PathSource {
                claim_name: None,
                path: "m.gguf".into(),
            }),
            ..Default::default()
        };
        let e = model_mount(&relative, "c").unwrap_err();
        assert!(matches!(e, RenderError::RelativeHostPath(_)), "{e}");
        assert!(e.to_string().contains("absolute"), "{e}");
    }
}
