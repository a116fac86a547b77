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
    /// Elements of one token's keys (or values) in one layer.
    pub fn token_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Elements of one layer's keys (or values) for a whole block.
    pub fn block_layer_elems(&self) -> usize {
        self.block_size * self.token_elems()
    }

    /// Elements in one block (all layers, keys and values).
    pub fn block_elems(&self) -> usize {
        self.n_layers * 2 * self.block_layer_elems()
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Element offset of the keys (`value == false`) or values of `slot` in `layer` of `block`.
    pub fn offset(&self, block: usize, layer: usize, value: bool, slot: usize) -> usize {
        block * self.block_elems()
            + (layer * 2 + usize::from(value)) * self.block_layer_elems()
            + slot * self.token_elems()
    }
}

/// Memory that backs a KV pool. The transport that moves blocks between processes provides it
/// (UCX-allocated, registered memory); [`HeapRegion`] is plain memory for a single process.
pub trait KvRegion: Send {
    /// The whole region.
    fn bytes(&self) -> &[u8];
    /// The whole region, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

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
}

/// Typed element access shared by the attention kernel and the cache writer.
pub trait KvElem: bytemuck::Pod + Send + Sync {
    /// Widen to f32.
    fn load(self) -> f32;
    /// Narrow from f32.
    fn store(v: f32) -> Self;
}

impl KvElem for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
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
        let align = layout.dtype.size();
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
    pub fn on_heap(layout: KvLayout, num_blocks: usize) -> Self {
        let region = HeapRegion::new(num_blocks * layout.block_bytes());
        Self::new(layout, num_blocks, Box::new(region)).expect("heap region is sized and aligned")
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

    /// The region as elements of type `T` (which must match the layout's dtype).
    pub fn elems<T: KvElem>(&self) -> &[T] {
        let bytes = &self.region.bytes()[..self.num_blocks * self.layout.block_bytes()];
        bytemuck::cast_slice(bytes)
    }

    /// The region as writable elements of type `T`.
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
