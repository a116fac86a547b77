//! The KV pool's memory: one region handed in by the caller, carved into fixed-size blocks.
//!
//! A block holds, for every layer, the keys then the values of `block_size` token slots:
//! `[layer][k|v][slot][kv_head][dim]`. Keeping a block contiguous lets a peer read or write a
//! whole block (or a run of blocks) with one RMA operation by offset.

use half::f16;

/// The element type of stored keys and values (defined with the other flag choices in
/// `cleave-types`).
pub use cleave_types::choices::KvDtype;

/// Where each token's keys and values live inside the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub n_layers: usize,
    /// Key/value heads held by this process.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Stored units (see [`KvDtype::unit_elems`]) of one head's keys (or values) at one token.
    pub fn head_units(&self) -> usize {
        self.head_dim / self.dtype.unit_elems()
    }

    /// Elements of one token's keys (or values) in one layer.
    pub fn token_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Units of one token's keys (or values) in one layer.
    pub fn token_units(&self) -> usize {
        self.n_kv_heads * self.head_units()
    }

    /// Units of one layer's keys (or values) for a whole block.
    pub fn block_layer_units(&self) -> usize {
        self.block_size * self.token_units()
    }

    /// Units in one block (all layers, keys and values).
    pub fn block_units(&self) -> usize {
        self.n_layers * 2 * self.block_layer_units()
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_units() * self.dtype.unit_bytes()
    }

    /// Unit offset of the keys (`value == false`) or values of `slot` in `layer` of `block`.
    pub fn offset(&self, block: usize, layer: usize, value: bool, slot: usize) -> usize {
        block * self.block_units()
            + (layer * 2 + usize::from(value)) * self.block_layer_units()
            + slot * self.token_units()
    }

    /// Whether the element type can store this model's rows: a block-quantized type needs a
    /// head size that is a whole number of its blocks.
    pub fn check(&self) -> Result<(), KvMemoryError> {
        let unit = self.dtype.unit_elems();
        if !self.head_dim.is_multiple_of(unit) {
            return Err(KvMemoryError::HeadSize {
                dtype: self.dtype.as_str(),
                unit,
                head_dim: self.head_dim,
            });
        }
        Ok(())
    }

    /// The alignment the region needs for the element type.
    fn align(&self) -> usize {
        match self.dtype {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Q8_0 => 1,
        }
    }
}

/// Memory that backs a KV pool (the trait lives in `cleave-types`, where the transport that
/// provides it implements it without linking the engine).
pub use cleave_types::kv::KvRegion;

/// A region allocated on the heap, 8-byte aligned.
pub struct HeapRegion(Vec<u64>);

impl HeapRegion {
    /// A zeroed region of at least `bytes` bytes.
    pub fn new(bytes: usize) -> Self {
        HeapRegion(vec![0u64; bytes.div_ceil(8)])
    }
}

impl KvRegion for HeapRegion {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

/// Errors setting up the KV memory.
#[derive(Debug, thiserror::Error)]
pub enum KvMemoryError {
    /// The region cannot hold the requested number of blocks.
    #[error("KV region of {have} bytes is too small for {blocks} blocks of {block_bytes} bytes")]
    TooSmall {
        /// Bytes in the region.
        have: usize,
        /// Blocks requested.
        blocks: usize,
        /// Bytes per block.
        block_bytes: usize,
    },
    /// The region is not aligned for the element type.
    #[error("KV region is not aligned to {0} bytes")]
    Misaligned(usize),
    /// The model's head size is not a whole number of the element type's blocks.
    #[error(
        "--kv-dtype {dtype} stores blocks of {unit} elements, but this model's head size is \
         {head_dim}: choose f16 or f32"
    )]
    HeadSize {
        /// The KV dtype's flag value.
        dtype: &'static str,
        /// Elements per block of that dtype.
        unit: usize,
        /// The model's head size.
        head_dim: usize,
    },
}

/// A stored unit of keys or values ([`KvDtype::unit_elems`] elements): the one type the
/// attention kernels and the cache writer are generic over. A row is a slice of units; its
/// elements widen to f32 the same way on every path, so every kernel agrees bit for bit.
pub trait KvElem: bytemuck::Pod + Send + Sync {
    /// Element `i` of `row`, widened to f32.
    fn get(row: &[Self], i: usize) -> f32;
    /// Elements `8c .. 8c + 8` of `row`, widened to f32 (a unit holds 1 or a multiple of 8).
    fn chunk8(row: &[Self], c: usize) -> [f32; 8];
    /// Narrows `src` into `dst` (`dst.len()` units of `src.len()` elements).
    fn store_row(src: &[f32], dst: &mut [Self]);
}

impl KvElem for f32 {
    #[inline(always)]
    fn get(row: &[f32], i: usize) -> f32 {
        row[i]
    }
    #[inline(always)]
    fn chunk8(row: &[f32], c: usize) -> [f32; 8] {
        let s = &row[8 * c..8 * c + 8];
        std::array::from_fn(|l| s[l])
    }
    fn store_row(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn get(row: &[f16], i: usize) -> f32 {
        row[i].to_f32()
    }
    #[inline(always)]
    fn chunk8(row: &[f16], c: usize) -> [f32; 8] {
        let s = &row[8 * c..8 * c + 8];
        std::array::from_fn(|l| s[l].to_f32())
    }
    fn store_row(src: &[f32], dst: &mut [f16]) {
        for (d, x) in dst.iter_mut().zip(src) {
            *d = f16::from_f32(*x);
        }
    }
}

/// One Q8_0 block of keys or values, as llama.cpp lays it out: an f16 scale `d` and 32 signed
/// bytes; element `j` is `qs[j] · d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Q8Block {
    /// The scale, an f16's bits (little-endian bytes: the block is unaligned in the region).
    pub d: [u8; 2],
    /// The quants.
    pub qs: [i8; 32],
}

impl Q8Block {
    /// The scale, widened to f32.
    #[inline(always)]
    pub fn scale(&self) -> f32 {
        f16::from_le_bytes(self.d).to_f32()
    }

    /// Quantizes 32 elements as llama.cpp's reference quantizer does: `d = amax / 127` (kept at
    /// full precision to round the quants, stored as f16), `qs[j] = round(x[j] / d)`.
    pub fn quantize(x: &[f32]) -> Q8Block {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        Q8Block {
            d: f16::from_f32(d).to_le_bytes(),
            qs: std::array::from_fn(|j| (x[j] * id).round() as i8),
        }
    }
}

impl KvElem for Q8Block {
    #[inline(always)]
    fn get(row: &[Q8Block], i: usize) -> f32 {
        let b = &row[i / 32];
        f32::from(b.qs[i % 32]) * b.scale()
    }
    #[inline(always)]
    fn chunk8(row: &[Q8Block], c: usize) -> [f32; 8] {
        let b = &row[c / 4];
        let (d, q) = (b.scale(), &b.qs[8 * (c % 4)..8 * (c % 4) + 8]);
        std::array::from_fn(|l| f32::from(q[l]) * d)
    }
    fn store_row(src: &[f32], dst: &mut [Q8Block]) {
        for (d, x) in dst.iter_mut().zip(src.chunks_exact(32)) {
            *d = Q8Block::quantize(x);
        }
    }
}

/// The KV memory of one process: a layout over a region.
pub struct KvCache {
    layout: KvLayout,
    num_blocks: usize,
    region: Box<dyn KvRegion>,
}

impl KvCache {
    /// Uses `region` for `num_blocks` blocks of `layout`.
    pub fn new(
        layout: KvLayout,
        num_blocks: usize,
        region: Box<dyn KvRegion>,
    ) -> Result<Self, KvMemoryError> {
        let need = num_blocks * layout.block_bytes();
        let have = region.bytes().len();
        if have < need {
            return Err(KvMemoryError::TooSmall {
                have,
                blocks: num_blocks,
                block_bytes: layout.block_bytes(),
            });
        }
        layout.check()?;
        let align = layout.align();
        if !(region.bytes().as_ptr() as usize).is_multiple_of(align) {
            return Err(KvMemoryError::Misaligned(align));
        }
        Ok(KvCache {
            layout,
            num_blocks,
            region,
        })
    }

    /// A heap-backed cache.
    ///
    /// # Panics
    /// When the dtype cannot store the layout's heads ([`KvLayout::check`]: callers that take the
    /// dtype from a user check first).
    pub fn on_heap(layout: KvLayout, num_blocks: usize) -> Self {
        let region = HeapRegion::new(num_blocks * layout.block_bytes());
        Self::new(layout, num_blocks, Box::new(region)).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks in the region.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Raw bytes of the region (for transports).
    pub fn region(&self) -> &[u8] {
        self.region.bytes()
    }

    /// Raw writable bytes of the region (for transports).
    pub fn region_mut(&mut self) -> &mut [u8] {
        self.region.bytes_mut()
    }

    /// The region as units of type `T` (which must match the layout's dtype).
    pub fn elems<T: KvElem>(&self) -> &[T] {
        let bytes = &self.region.bytes()[..self.num_blocks * self.layout.block_bytes()];
        bytemuck::cast_slice(bytes)
    }

    /// The region as writable units of type `T`.
    pub fn elems_mut<T: KvElem>(&mut self) -> &mut [T] {
        let n = self.num_blocks * self.layout.block_bytes();
        bytemuck::cast_slice_mut(&mut self.region.bytes_mut()[..n])
    }

    /// Copies block `src` onto block `dst` (copy-on-write of a shared, partly filled block).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let bb = self.layout.block_bytes();
        self.region
            .bytes_mut()
            .copy_within(src * bb..(src + 1) * bb, dst * bb);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::Zeroable;

    /// Q8_0 blocks follow llama.cpp's reference quantizer: the largest magnitude maps to ±127,
    /// quants round half away from zero with the unrounded scale, the scale is stored as f16,
    /// and an all-zero block stores zeros (no division by zero).
    #[test]
    fn q8_blocks_quantize_as_llama_cpp_does() {
        let mut x = [0.0f32; 32];
        x[0] = -254.0; // the scale is 2
        x[1] = 128.0;
        x[2] = 3.0; // 1.5 rounds away from zero
        x[3] = -1.0; // -0.5 rounds away from zero
        x[4] = 0.9; // 0.45 rounds to 0
        let b = Q8Block::quantize(&x);
        assert_eq!(&b.qs[..6], &[-127, 64, 2, -1, 0, 0]);
        assert_eq!(b.scale(), 2.0);
        let mut row = [Q8Block::zeroed(); 1];
        Q8Block::store_row(&x, &mut row);
        assert_eq!(row[0], b);
        assert_eq!(Q8Block::get(&row, 1), 64.0 * b.scale());
        let zero = Q8Block::quantize(&[0.0; 32]);
        assert_eq!((zero.scale(), zero.qs), (0.0, [0; 32]));
    }

    /// A Q8_0 pool refuses a model whose head size is not a whole number of blocks, naming the
    /// flag and the head size.
    #[test]
    fn q8_pool_refuses_heads_that_are_not_whole_blocks() {
        let layout = KvLayout {
            n_layers: 1,
            n_kv_heads: 2,
            head_dim: 48,
            block_size: 16,
            dtype: KvDtype::Q8_0,
        };
        let region = Box::new(HeapRegion::new(1 << 16));
        let err = KvCache::new(layout, 1, region).err().expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("q8_0") && msg.contains("48"), "{msg}");
        let ok = KvLayout {
            head_dim: 64,
            ..layout
        };
        assert_eq!(ok.block_bytes(), 2 * 16 * 2 * 2 * 34);
        assert!(KvCache::new(ok, 1, Box::new(HeapRegion::new(1 << 16))).is_ok());
    }
}
