//! Tests of the GGUF reader: the real model, truncated and corrupt inputs, hand-built files.

use super::*;

fn real_model() -> Option<GgufFile> {
    let path = default_model_path();
    if !path.exists() {
        eprintln!("skipping: model not found at {}", path.display());
        return None;
    }
    Some(GgufFile::open(&path).expect("open real model"))
}

#[test]
fn real_model_metadata_and_tensors() {
    let Some(g) = real_model() else { return };
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(g.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(g.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(g.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert!(!g.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(g.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap() > 0.0);
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    assert_eq!(
        g.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(
        g.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49152
    );

    let emb = g.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.dims, vec![576, 49152]);
    assert_eq!(emb.ty, GgmlType::Q8_0);
    assert_eq!(
        g.tensor_data("token_embd.weight").unwrap().len(),
        576 * 49152 / 32 * 34
    );
    let q = g.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.ty, GgmlType::Q4_1);
    assert_eq!(q.dims, vec![576, 576]);
    let norm = g.tensor_f32("blk.0.attn_norm.weight").unwrap();
    assert_eq!(norm.len(), 576);
    assert!(norm.iter().all(|x| x.is_finite()));

    match g.tensor_f32("blk.0.attn_q.weight") {
        Err(GgufError::UnsupportedTensorType { tensor, ty }) => {
            assert_eq!(tensor, "blk.0.attn_q.weight");
            assert_eq!(ty, GgmlType::Q4_1);
        }
        other => panic!("expected UnsupportedTensorType, got {other:?}"),
    }
    assert!(matches!(g.tensor("nope"), Err(GgufError::MissingTensor(n)) if n == "nope"));
    assert!(matches!(g.get_u32("nope"), Err(GgufError::MissingKey(_))));
    assert!(matches!(
        g.get_u32("general.architecture"),
        Err(GgufError::WrongType { .. })
    ));
    // Every tensor's bytes lie inside the file.
    for t in &g.tensors {
        g.tensor_data(&t.name).unwrap();
    }
}

#[test]
fn truncated_real_header_errors() {
    use std::io::Read;
    let Some(full) = real_model() else { return };
    let header_end = full.data_offset;
    // Only the header is needed: read the first `header_end` bytes.
    let mut bytes = Vec::new();
    std::fs::File::open(default_model_path())
        .unwrap()
        .take(header_end as u64)
        .read_to_end(&mut bytes)
        .unwrap();
    assert_eq!(bytes.len(), header_end);
    let mut cuts: Vec<usize> = vec![0, 3, 4, 8, 16, 23, 24, 100, 1000, 4096, 100_000, 1 << 20];
    cuts.extend((0..200).map(|i| i * header_end / 200));
    cuts.push(header_end - 1);
    for cut in cuts {
        if cut >= header_end {
            continue;
        }
        let r = GgufFile::from_bytes(bytes[..cut].to_vec());
        assert!(r.is_err(), "prefix of {cut} bytes parsed");
    }
    // The header alone parses, but the tensor bytes are out of bounds.
    let g = GgufFile::from_bytes(bytes[..header_end].to_vec()).unwrap();
    assert!(matches!(
        g.tensor_data("token_embd.weight"),
        Err(GgufError::TensorOutOfBounds(_))
    ));
}

#[test]
fn bad_magic_and_version() {
    assert!(matches!(
        GgufFile::from_bytes(b"GGML\x03\0\0\0".to_vec()),
        Err(GgufError::BadMagic)
    ));
    assert!(matches!(
        GgufFile::from_bytes(Vec::new()),
        Err(GgufError::BadMagic)
    ));
    let mut b = Builder::new(1);
    b.finish_header();
    assert!(matches!(
        GgufFile::from_bytes(b.bytes),
        Err(GgufError::UnsupportedVersion(1))
    ));
}

/// Writes GGUF files by hand.
struct Builder {
    bytes: Vec<u8>,
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<u8>,
    n_tensors: u64,
}

impl Builder {
    fn new(version: u32) -> Self {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(version.to_le_bytes());
        Builder {
            bytes,
            kv: Vec::new(),
            n_kv: 0,
            tensors: Vec::new(),
            n_tensors: 0,
        }
    }

    fn str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn kv(&mut self, key: &str, ty: u32, value: &[u8]) {
        Self::str(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
    }

    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) {
        Self::str(&mut self.tensors, name);
        self.tensors.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.tensors.extend(d.to_le_bytes());
        }
        self.tensors.extend(ty.to_le_bytes());
        self.tensors.extend(offset.to_le_bytes());
        self.n_tensors += 1;
    }

    /// Appends counts, metadata and tensor descriptors, then pads to `align`.
    fn finish_header(&mut self) {
        self.bytes.extend(self.n_tensors.to_le_bytes());
        self.bytes.extend(self.n_kv.to_le_bytes());
        self.bytes.append(&mut self.kv);
        self.bytes.append(&mut self.tensors);
    }

    fn pad(&mut self, align: usize) {
        self.bytes
            .resize(self.bytes.len().next_multiple_of(align), 0);
    }
}

fn tiny(align: Option<u32>) -> Vec<u8> {
    let mut b = Builder::new(3);
    b.kv("general.architecture", 8, &{
        let mut v = Vec::new();
        Builder::str(&mut v, "llama");
        v
    });
    b.kv("a.u8", 0, &[7]);
    b.kv("a.i32", 5, &(-3i32).to_le_bytes());
    b.kv("a.f64", 12, &1.5f64.to_le_bytes());
    b.kv("a.bool", 7, &[1]);
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend(2u64.to_le_bytes());
    Builder::str(&mut arr, "x");
    Builder::str(&mut arr, "yz");
    b.kv("a.strs", 9, &arr);
    let mut ints = 3u32.to_le_bytes().to_vec();
    ints.extend(3u64.to_le_bytes());
    for v in [1i16, -2, 3] {
        ints.extend(v.to_le_bytes());
    }
    b.kv("a.ints", 9, &ints);
    if let Some(a) = align {
        b.kv("general.alignment", 4, &a.to_le_bytes());
    }
    b.tensor("w", &[2, 2], 0, 0);
    b.tensor("h", &[3], 1, 16);
    b.finish_header();
    b.pad(align.unwrap_or(32) as usize);
    for v in [1.0f32, 2.0, 3.0, -4.0] {
        b.bytes.extend(v.to_le_bytes());
    }
    for v in [0.5f32, -1.0, 2.0] {
        b.bytes.extend(half::f16::from_f32(v).to_le_bytes());
    }
    b.bytes
}

#[test]
fn tiny_file_round_trips() {
    for align in [None, Some(64), Some(8)] {
        let g = GgufFile::from_bytes(tiny(align)).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.architecture().unwrap(), "llama");
        assert_eq!(g.get_u32("a.u8").unwrap(), 7);
        assert!(g.get_u32("a.i32").is_err());
        assert_eq!(g.meta("a.i32"), Some(&MetaValue::I32(-3)));
        assert_eq!(g.get_f32("a.f64").unwrap(), 1.5);
        assert!(g.get_bool("a.bool").unwrap());
        assert_eq!(g.get_str_array("a.strs").unwrap(), vec!["x", "yz"]);
        assert_eq!(g.get_i32_array("a.ints").unwrap(), vec![1, -2, 3]);
        assert!(g.get_str_array("a.ints").is_err());
        assert_eq!(g.tensor_f32("w").unwrap(), vec![1.0, 2.0, 3.0, -4.0]);
        assert_eq!(g.tensor_f32("h").unwrap(), vec![0.5, -1.0, 2.0]);
        assert_eq!(g.tensor("w").unwrap().n_elements(), 4);
        assert_eq!(g.tensor("h").unwrap().n_bytes(), Some(6));
    }
}

#[test]
fn tiny_file_every_prefix_is_safe() {
    let bytes = tiny(None);
    for cut in 0..bytes.len() {
        // Must not panic; short prefixes error, longer ones may parse with tensors out of bounds.
        if let Ok(g) = GgufFile::from_bytes(bytes[..cut].to_vec()) {
            assert!(g.tensor_f32("h").is_err());
        }
    }
}

#[test]
fn corrupt_counts_do_not_allocate() {
    // A huge metadata count, a huge string length and a huge array length.
    let mut b = Builder::new(3);
    b.finish_header();
    let mut huge = b.bytes.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(huge),
        Err(GgufError::Truncated { .. })
    ));

    let mut b = Builder::new(3);
    let mut arr = 4u32.to_le_bytes().to_vec();
    arr.extend((u64::MAX / 2).to_le_bytes());
    b.kv("big", 9, &arr);
    b.finish_header();
    assert!(matches!(
        GgufFile::from_bytes(b.bytes),
        Err(GgufError::Truncated { .. })
    ));

    let mut b = Builder::new(3);
    b.kv("bad", 99, &[0; 16]);
    b.finish_header();
    assert!(matches!(
        GgufFile::from_bytes(b.bytes),
        Err(GgufError::BadValueType(99))
    ));

    let mut b = Builder::new(2);
    b.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
    b.finish_header();
    assert!(matches!(
        GgufFile::from_bytes(b.bytes),
        Err(GgufError::TooManyDims { .. })
    ));

    // A tensor whose offset points past the end, and one with an absurd shape.
    let mut b = Builder::new(3);
    b.tensor("far", &[4], 0, u64::MAX - 2);
    b.tensor("wide", &[u64::MAX, u64::MAX], 0, 0);
    b.tensor("odd", &[33], 8, 0);
    b.tensor("iq2", &[256], 16, 0);
    b.finish_header();
    let g = GgufFile::from_bytes(b.bytes).unwrap();
    assert!(matches!(
        g.tensor_data("far"),
        Err(GgufError::TensorOutOfBounds(_))
    ));
    assert!(matches!(
        g.tensor_data("wide"),
        Err(GgufError::TensorOutOfBounds(_))
    ));
    match g.tensor_data("odd") {
        Err(e @ GgufError::BadShape { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("\"odd\"") && msg.contains("q8_0"), "{msg}");
        }
        other => panic!("expected BadShape, got {other:?}"),
    }
    match g.tensor_data("iq2") {
        Err(GgufError::UnsupportedTensorType { tensor, ty }) => {
            assert_eq!(
                (tensor.as_str(), ty.to_string()),
                ("iq2", "iq2_xxs".to_string())
            )
        }
        other => panic!("expected UnsupportedTensorType, got {other:?}"),
    }
}

#[test]
fn nested_arrays_limited() {
    let mut b = Builder::new(3);
    let mut v = Vec::new();
    for _ in 0..20 {
        v.extend(9u32.to_le_bytes());
        v.extend(1u64.to_le_bytes());
    }
    v.extend(0u32.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    b.kv("deep", 9, &v);
    b.finish_header();
    assert!(matches!(
        GgufFile::from_bytes(b.bytes),
        Err(GgufError::NestingTooDeep)
    ));
}

#[test]
fn default_path_ends_with_model_name() {
    let p = default_model_path();
    #[allow(clippy::disallowed_methods)] // a test reads the test environment
    if std::env::var_os("CLEAVE_MODEL").is_none() {
        assert!(p.ends_with("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
}

#[test]
fn block_sizes_of_the_quantized_types() {
    // (id, elements per block, bytes per block), as ggml's type traits.
    for (id, block, size) in [
        (2, 32, 18),
        (3, 32, 20),
        (6, 32, 22),
        (7, 32, 24),
        (8, 32, 34),
        (10, 256, 84),
        (11, 256, 110),
        (12, 256, 144),
        (13, 256, 176),
        (14, 256, 210),
        (15, 256, 292),
        (20, 32, 18),
        (30, 1, 2),
    ] {
        let ty = GgmlType::from_id(id);
        assert_eq!(ty.id(), id);
        assert!(!matches!(ty, GgmlType::Other(_)), "{id}");
        assert_eq!(
            (ty.block_size(), ty.type_size()),
            (Some(block), Some(size)),
            "{ty}"
        );
    }
    assert_eq!(GgmlType::from_id(16).block_size(), None);
    assert_eq!(GgmlType::from_id(34).to_string(), "tq1_0");
}

#[test]
fn tensor_sizes_are_checked_against_the_next_tensor() {
    // A Q4_K tensor of 2 × 256 needs 288 bytes; the next one starts 256 bytes after it.
    let mut b = Builder::new(3);
    b.tensor("a", &[256, 2], 12, 0);
    b.tensor("b", &[4], 0, 256);
    b.finish_header();
    b.pad(32);
    b.bytes.resize(b.bytes.len() + 512, 0);
    match GgufFile::from_bytes(b.bytes) {
        Err(e @ GgufError::TensorSize { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("\"a\"") && msg.contains("q4_K") && msg.contains("288"),
                "{msg}"
            );
        }
        other => panic!("expected TensorSize, got {other:?}"),
    }
    // With room for it, both tensors read.
    let mut b = Builder::new(3);
    b.tensor("a", &[256, 2], 12, 0);
    b.tensor("b", &[4], 30, 288);
    b.finish_header();
    b.pad(32);
    b.bytes.resize(b.bytes.len() + 288, 0);
    // b: BF16 1.0, -2.0, 0.5, 3.0.
    for v in [0x3f80u16, 0xc000, 0x3f00, 0x4040] {
        b.bytes.extend(v.to_le_bytes());
    }
    let g = GgufFile::from_bytes(b.bytes).unwrap();
    assert_eq!(g.tensor_data("a").unwrap().len(), 288);
    assert_eq!(g.tensor_f32("b").unwrap(), vec![1.0, -2.0, 0.5, 3.0]);
}
