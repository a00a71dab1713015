//! Chat-level text handling around the model: parsing generated text into reasoning, content and
//! tool calls.

pub mod reasoning;
pub mod tools;
