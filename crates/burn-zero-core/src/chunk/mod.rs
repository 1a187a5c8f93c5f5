//! Chunks: the parameters of a sharded module packed into a few groups that are gathered,
//! reduced and stepped as one (ColossalAI Gemini's chunks, PyTorch FSDP2's parameter groups).
//!
//! Every parameter keeps its own even split over the ranks (its padded blocks, as without
//! chunks), and a chunk's shard on a rank is its members' blocks of that rank, one after the
//! other: one flat tensor per chunk and rank. Gathering a chunk is one all-gather of those
//! shards followed by a copy-out of each member; reducing it is one reduce-scatter (or
//! all-reduce) of its members' gradients packed in the same order, whose result on each rank
//! is the flat gradient of its shard. What a checkpoint stores per parameter does not change.
//!
//! [`ChunkLayout`] is fixed at `shard` time from the parameters in module visit order, which
//! every rank knows before any pass runs (the recorded first-use order only exists after a
//! pass, and the layout decides where masters and optimizer state live, so it cannot move
//! afterwards); for the sequential models ZeRO targets, visit order is forward order.
//! [`placement`] decides from it which chunks keep their parameter shards in host memory.

mod block;
mod layout;
pub mod placement;
mod search;

pub use block::BlockLayout;
pub use layout::{Chunk, ChunkKind, ChunkLayout, ChunkMember, ChunkParam};
pub use search::{ChunkSearch, ChunkSize, SearchLimits};
