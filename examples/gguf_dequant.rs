//! Every tensor of a GGUF file dequantised to f32 by lily, as safetensors (PyTorch shapes), for
//! the bit-for-bit comparison with gguf-py (tools/check_gguf.py):
//!
//!     cargo run --example gguf_dequant -- IN.gguf OUT.safetensors

use std::path::PathBuf;

use lily::checkpoint::gguf::GgufFile;
use lily::checkpoint::{safetensors, tensor::DType};
use lily::ggml;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        anyhow::bail!("usage: gguf_dequant IN.gguf OUT.safetensors");
    };
    let file = GgufFile::open(&PathBuf::from(input))?;
    let mut tensors = Vec::new();
    for (name, t) in &file.tensors {
        let mut values = vec![0f32; t.shape.iter().product()];
        ggml::dequantize_row(t.ggml_type, t.data.as_slice(), &mut values);
        tensors.push((
            name.clone(),
            DType::F32,
            t.shape.clone(),
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
    }
    safetensors::write_file(&PathBuf::from(output), &tensors)?;
    Ok(())
}
