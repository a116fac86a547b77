//! This core's int8 dot-product peak: the kernels' own integer dot instructions (`vpmaddubsw` +
//! `vpmaddwd` on AVX2, 512-bit `vpdpbusd` on AVX512-VNNI) on registers only, in independent
//! chains, with no memory traffic. `cleave bench engine` measures prefill's matrix work against
//! it.

use std::arch::asm;
use std::time::{Duration, Instant};

use super::super::isa::{isa, Isa};

/// u8 × i8 multiply-adds per iteration of [`avx2_loop`]: six 32-byte dots.
const AVX2_MACS: u64 = 6 * 32;
/// u8 × i8 multiply-adds per iteration of [`vnni_loop`]: sixteen 64-byte dots.
const VNNI_MACS: u64 = 16 * 64;

/// `iters` iterations of six independent AVX2 dots (each `vpmaddubsw`, `vpmaddwd`, `vpaddd`
/// into its own accumulator), as `dot_avx2` computes them.
#[target_feature(enable = "avx2")]
fn avx2_loop(iters: u64) {
    // SAFETY: registers only (no memory operand, no stack); the function's target feature
    // guarantees AVX2; the counter is nonzero (callers pass at least 1).
    unsafe {
        asm!(
            "vpcmpeqb ymm0, ymm0, ymm0",
            "vpxor ymm1, ymm1, ymm1",
            "vpcmpeqw ymm15, ymm15, ymm15",
            "2:",
            "vpmaddubsw ymm2, ymm0, ymm1",
            "vpmaddubsw ymm3, ymm0, ymm1",
            "vpmaddubsw ymm4, ymm0, ymm1",
            "vpmaddubsw ymm5, ymm0, ymm1",
            "vpmaddubsw ymm6, ymm0, ymm1",
            "vpmaddubsw ymm7, ymm0, ymm1",
            "vpmaddwd ymm2, ymm2, ymm15",
            "vpmaddwd ymm3, ymm3, ymm15",
            "vpmaddwd ymm4, ymm4, ymm15",
            "vpmaddwd ymm5, ymm5, ymm15",
            "vpmaddwd ymm6, ymm6, ymm15",
            "vpmaddwd ymm7, ymm7, ymm15",
            "vpaddd ymm8, ymm8, ymm2",
            "vpaddd ymm9, ymm9, ymm3",
            "vpaddd ymm10, ymm10, ymm4",
            "vpaddd ymm11, ymm11, ymm5",
            "vpaddd ymm12, ymm12, ymm6",
            "vpaddd ymm13, ymm13, ymm7",
            "dec {n}",
            "jnz 2b",
            "vzeroupper",
            n = inout(reg) iters => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
            out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
            out("ymm10") _, out("ymm11") _, out("ymm12") _, out("ymm13") _, out("ymm15") _,
            options(nostack, nomem),
        );
    }
}

/// `iters` iterations of sixteen independent 512-bit `vpdpbusd` accumulations (enough chains to
/// cover its latency at two per cycle).
#[target_feature(enable = "avx512f,avx512vnni")]
fn vnni_loop(iters: u64) {
    // SAFETY: registers only (no memory operand, no stack); the function's target features
    // guarantee AVX512F and AVX512-VNNI; the counter is nonzero (callers pass at least 1).
    unsafe {
        asm!(
            "vpternlogd zmm0, zmm0, zmm0, 0xff",
            "vpxord zmm1, zmm1, zmm1",
            "2:",
            "vpdpbusd zmm8, zmm0, zmm1",
            "vpdpbusd zmm9, zmm0, zmm1",
            "vpdpbusd zmm10, zmm0, zmm1",
            "vpdpbusd zmm11, zmm0, zmm1",
            "vpdpbusd zmm12, zmm0, zmm1",
            "vpdpbusd zmm13, zmm0, zmm1",
            "vpdpbusd zmm14, zmm0, zmm1",
            "vpdpbusd zmm15, zmm0, zmm1",
            "vpdpbusd zmm16, zmm0, zmm1",
            "vpdpbusd zmm17, zmm0, zmm1",
            "vpdpbusd zmm18, zmm0, zmm1",
            "vpdpbusd zmm19, zmm0, zmm1",
            "vpdpbusd zmm20, zmm0, zmm1",
            "vpdpbusd zmm21, zmm0, zmm1",
            "vpdpbusd zmm22, zmm0, zmm1",
            "vpdpbusd zmm23, zmm0, zmm1",
            "dec {n}",
            "jnz 2b",
            "vzeroupper",
            n = inout(reg) iters => _,
            out("zmm0") _, out("zmm1") _, out("zmm8") _, out("zmm9") _, out("zmm10") _,
            out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
            out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _,
            out("zmm21") _, out("zmm22") _, out("zmm23") _,
            options(nostack, nomem),
        );
    }
}

/// The int8 multiply-add rate of one thread on the backend in use (GMAC/s, the best of three
/// timed runs of at least `min` each), and the instructions measured; `None` on the scalar
/// backend.
pub(in crate::kernels) fn int8_peak(min: Duration) -> Option<(f64, &'static str)> {
    let (run, macs, what): (fn(u64), u64, &'static str) = match isa() {
        Isa::Scalar => return None,
        // SAFETY (both arms): `isa()` returns Avx2 / Vnni only after detecting their features.
        Isa::Avx2 => (
            |n| unsafe { avx2_loop(n) },
            AVX2_MACS,
            "vpmaddubsw+vpmaddwd, 256-bit",
        ),
        Isa::Vnni => (|n| unsafe { vnni_loop(n) }, VNNI_MACS, "vpdpbusd, 512-bit"),
    };
    let mut iters = 1u64 << 16;
    run(iters);
    let mut best = 0f64;
    let mut timed = 0;
    while timed < 3 {
        let t = Instant::now();
        run(iters);
        let dt = t.elapsed();
        if dt < min {
            iters *= 2;
            continue;
        }
        best = best.max((iters * macs) as f64 / dt.as_secs_f64() / 1e9);
        timed += 1;
    }
    Some((best, what))
}
