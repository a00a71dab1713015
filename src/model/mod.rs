//! What all backends share: the canonical weights, per-sequence state, and the CPU reference.

pub mod cpu;
pub mod state;
pub mod weights;

pub use state::SequenceState;
pub use weights::Weights;
