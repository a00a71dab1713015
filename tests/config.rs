//! config.json parsing and validation.

use lily::checkpoint::synth::preset;
use lily::config::{ConfigError, LayerKind, ModelConfig};
use serde_json::json;

fn full() -> serde_json::Value {
    preset("qwen3.6-35b-a3b").unwrap()
}

#[test]
fn full_config_parses_with_the_real_numbers() {
    let c = ModelConfig::from_json(&full()).unwrap();
    assert_eq!(c.hidden_size, 2048);
    assert_eq!(c.rotary_dim, 64);
    assert_eq!(c.conv_dim(), 8192);
    assert_eq!(c.rope_theta, 1e7);
    let full_layers: Vec<usize> = (0..40)
        .filter(|&i| c.layer_types[i] == LayerKind::FullAttention)
        .collect();
    assert_eq!(full_layers, vec![3, 7, 11, 15, 19, 23, 27, 31, 35, 39]);
    // MODEL.md §7.
    let counts = c.parameter_counts();
    assert_eq!(counts.total, 34_660_610_688);
    assert_eq!(counts.active, 2_946_431_616);
}

#[test]
fn text_only_form_and_layer_interval_default() {
    let mut t = full()["text_config"].clone();
    t.as_object_mut().unwrap().remove("layer_types");
    let c = ModelConfig::from_json(&t).unwrap();
    assert!(c.is_full_attention(3) && !c.is_full_attention(4) && c.is_full_attention(39));
}

fn error_for(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v = full();
    edit(&mut v);
    match ModelConfig::from_json(&v) {
        Err(e @ ConfigError::Field { .. }) => e.to_string(),
        other => panic!("expected a field error, got {other:?}"),
    }
}

#[test]
fn mismatches_name_the_field_and_the_expectation() {
    let e = error_for(|v| v["text_config"]["hidden_act"] = json!("gelu"));
    assert!(
        e.contains("text_config.hidden_act") && e.contains("\"silu\""),
        "{e}"
    );
    let e = error_for(|v| v["model_type"] = json!("llama"));
    assert!(e.contains("model_type") && e.contains("qwen3_5_moe"), "{e}");
    let e = error_for(|v| v["text_config"]["num_key_value_heads"] = json!(3));
    assert!(
        e.contains("num_key_value_heads") && e.contains("divisor"),
        "{e}"
    );
    let e = error_for(|v| v["text_config"]["linear_num_key_heads"] = json!(5));
    assert!(e.contains("linear_num_key_heads"), "{e}");
    let e = error_for(|v| v["text_config"]["num_experts_per_tok"] = json!(300));
    assert!(e.contains("num_experts_per_tok"), "{e}");
    let e = error_for(|v| v["text_config"]["layer_types"] = json!(["full_attention"]));
    assert!(e.contains("layer_types") && e.contains("40 entries"), "{e}");
    let e = error_for(|v| v["text_config"]["layer_types"][2] = json!("sliding"));
    assert!(e.contains("layer_types[2]"), "{e}");
    let e = error_for(|v| v["text_config"]["hidden_size"] = json!("big"));
    assert!(
        e.contains("text_config.hidden_size") && e.contains("integer"),
        "{e}"
    );
    let e = error_for(|v| {
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("num_experts");
    });
    assert!(e.contains("num_experts") && e.contains("missing"), "{e}");
    let e = error_for(|v| v["text_config"]["rope_parameters"]["rope_type"] = json!("yarn"));
    assert!(e.contains("rope_type"), "{e}");
    let e =
        error_for(|v| v["text_config"]["rope_parameters"]["mrope_section"] = json!([11, 11, 11]));
    assert!(e.contains("mrope_section"), "{e}");
    let e = error_for(|v| v["text_config"]["attention_bias"] = json!(true));
    assert!(e.contains("attention_bias"), "{e}");
}

/// Absurd sizes (a corrupt file's) are errors that name the field, before anything is sized by
/// them: a trillion layers without `layer_types` would otherwise be a trillion-entry list.
#[test]
fn absurd_sizes_are_refused() {
    let e = error_for(|v| {
        let t = v["text_config"].as_object_mut().unwrap();
        t.remove("layer_types");
        t.insert("num_hidden_layers".into(), json!(1_000_000_000_000u64));
    });
    assert!(
        e.contains("num_hidden_layers") && e.contains("at most 1024"),
        "{e}"
    );
    for field in [
        "hidden_size",
        "vocab_size",
        "num_experts",
        "moe_intermediate_size",
    ] {
        let e = error_for(|v| v["text_config"][field] = json!(u64::MAX / 2));
        assert!(e.contains(field) && e.contains("at most"), "{e}");
    }
}
