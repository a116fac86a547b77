//! The instruction-set backends and their run-time selection.

use std::sync::OnceLock;

use super::WeightType;

/// An instruction-set backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Isa {
    pub(super) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni => "avx512vnni",
        }
    }

    /// Whether token tiles of 4, 8 and 16 use 512-bit token-pair accumulators for `ty`.
    pub(super) fn pairs(self, ty: WeightType) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Vnni {
            return matches!(
                ty,
                WeightType::Q4_0
                    | WeightType::Q4_1
                    | WeightType::Q5_0
                    | WeightType::Q5_1
                    | WeightType::Q8_0
                    | WeightType::Q4_K
                    | WeightType::Q5_K
                    | WeightType::Q6_K
            );
        }
        let _ = ty;
        false
    }

    /// All backends this CPU supports, best last.
    pub(super) fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                v.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512bw")
                {
                    v.push(Isa::Vnni);
                }
            }
        }
        v
    }
}

/// The backend in use: the best available, capped by `CLEAVE_SIMD=scalar|avx2` if set.
pub(super) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let avail = Isa::available();
        // A process-wide override read once, before any flag parser exists (tests set it per process).
        #[allow(clippy::disallowed_methods)]
        let cap = std::env::var("CLEAVE_SIMD").ok();
        let pick = avail
            .iter()
            .rev()
            .find(|i| cap.as_deref().is_none_or(|c| c == i.name()));
        *pick.unwrap_or(&avail[avail.len() - 1])
    })
}

/// Which SIMD path is active, for logs and benches: "avx512vnni", "avx2" or "scalar".
pub fn simd_path() -> &'static str {
    isa().name()
}
