//! The MTP head of the CPU reference (src/model/cpu/mtp.rs) against transformers' own layers
//! composed as vLLM composes the head (tools/make_mtp_fixtures.py, fixture tiny-a-mtp: tiny-a
//! with a random head), in f32.

mod common;

use common::{fixture_dir, rel_error, Reference};
use lily::checkpoint;
use lily::model::cpu::{forward, mtp, Logits};
use lily::model::state::{KvCache, MtpState};
use lily::model::{argmax, SequenceState};

/// As the CPU reference's own fixture tests (tests/model_cpu.rs): f32 throughout.
const F32_TOLERANCE: f32 = 1e-4;

#[test]
fn the_head_matches_transformers_layers() {
    let w = checkpoint::load(&fixture_dir("tiny-a-mtp")).unwrap();
    let head = w.mtp.as_ref().expect("the fixture has an MTP head");
    let reference = Reference::load("tiny-a-mtp");
    let (hd, v) = (w.config.hidden_size, w.config.vocab_size);
    assert!(reference.prompts() >= 3);
    for p in 0..reference.prompts() {
        let ids = reference.ids(p, "ids");
        let next = reference.ids(p, "next");
        let t = ids.len();

        // The model's final-normed hidden states, as a drafting sequence keeps them.
        let mut state = SequenceState::new(&w.config);
        state.mtp = Some(MtpState::default());
        let logits = forward(&w, &ids, &mut state, Logits::Last);
        assert_eq!(
            argmax(&logits),
            next[t - 1],
            "prompt {p}: the token after it"
        );
        let hidden = state.mtp.unwrap().pending;
        let err = rel_error(&hidden, &reference.f32s(p, "hidden"));
        assert!(
            err < F32_TOLERANCE,
            "prompt {p}: hidden states off by {err}"
        );

        // The head over the prompt's rows, from the reference's hidden states.
        let want_hidden = reference.f32s(p, "mtp_hidden");
        let want_logits = reference.f32s(p, "mtp_logits");
        let mut kv = KvCache::default();
        let ref_hidden = reference.f32s(p, "hidden");
        let (normed, logits) = mtp::forward(&w, head, &ref_hidden, &next, 0, &mut kv, Logits::All);
        let err = rel_error(&normed, &want_hidden);
        assert!(err < F32_TOLERANCE, "prompt {p}: head outputs off by {err}");
        let err = rel_error(&logits, &want_logits);
        assert!(err < F32_TOLERANCE, "prompt {p}: head logits off by {err}");

        // A second draft step on the head's own output, one position on.
        let draft = argmax(&logits[(t - 1) * v..]);
        let last = &normed[(t - 1) * hd..];
        let (_, step2) = mtp::forward(&w, head, last, &[draft], t, &mut kv, Logits::Last);
        let err = rel_error(&step2, &reference.f32s(p, "draft2"));
        assert!(
            err < F32_TOLERANCE,
            "prompt {p}: second draft step off by {err}"
        );
    }
}
