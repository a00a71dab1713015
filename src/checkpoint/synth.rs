//! Random checkpoints (placeholder, filled in next).
