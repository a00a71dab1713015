//! Text ⇄ token ids for the Qwen3.5/Qwen3.6 family, and the incremental detokenizer.
//!
//! The tokenizer is byte-level BPE (spec/MODEL.md §6.1). Encoding:
//! 1. the 33 added tokens (`<|im_start|>`, `<think>`, …) are cut out of the raw text as whole
//!    strings, wherever they appear: the chat template writes them into the prompt as text;
//! 2. each stretch of text between them is NFC-normalised, split by the pre-tokenizer regex
//!    [`SPLIT_PATTERN`], and each split piece is BPE-encoded on its UTF-8 bytes.
//!
//! This is the order of the reference (Hugging Face `tokenizers` with `normalized: false` added
//! tokens): added tokens are found *before* normalisation, so a combining mark right after
//! `<|im_end|>` cannot merge into the `>`.
//!
//! Three sources, one behaviour:
//! * `tokenizer.json` (what Hugging Face model directories ship): the `tokenizers` crate runs the
//!   pipeline the file describes;
//! * a tiktoken rank file (`*.tiktoken`: `base64(token bytes) rank` per line): we run the steps
//!   above ourselves with `tiktoken-rs` doing the regex split and BPE;
//! * [`Tokenizer::byte_level_demo`]: a tiny vocabulary for the built-in demo model.
//!
//! Decoding is the same for all three: every id stands for a fixed byte string; a sequence of ids
//! decodes to the concatenation of its bytes. Those bytes need not be valid UTF-8 (a character can
//! be split across tokens), which is why [`IncrementalDecoder`] exists and why [`Tokenizer::decode`]
//! is strict while [`Tokenizer::decode_lossy`] replaces invalid sequences with U+FFFD.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;
use unicode_normalization::{is_nfc_quick, IsNormalized, UnicodeNormalization};

/// The Qwen3.5/3.6 pre-tokenizer regex (spec/MODEL.md §6.1). Unlike Qwen2/3, `\p{M}` joins letter
/// runs and digits are split one at a time.
pub const SPLIT_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The 33 added tokens of Qwen3.6, in id order: in the real vocabulary the first one is id 248044
/// (right after the 248,044 BPE tokens), so `<|im_end|>` = 248046 and `<think>` = 248068.
pub const ADDED_TOKENS: [&str; 33] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
];

/// Number of merges the demo tokenizer learns: 256 byte tokens + 223 merges + 33 added tokens
/// make [`DEMO_VOCAB_SIZE`] = 512 ids.
const DEMO_MERGES: usize = 223;

/// Vocabulary size of [`Tokenizer::byte_level_demo`]: ids 0..=255 are the single bytes (id = byte
/// value), 256..=478 the learnt merges, 479..=511 the [`ADDED_TOKENS`] in order.
pub const DEMO_VOCAB_SIZE: usize = 512;

/// Everything that can go wrong when loading a tokenizer or converting with it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("no tokenizer in {dir}: expected tokenizer.json or one *.tiktoken vocabulary file")]
    NotFound { dir: PathBuf },
    #[error("{dir} holds several *.tiktoken files ({found}); load one by path")]
    AmbiguousVocab { dir: PathBuf, found: String },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt vocabulary {path}, line {line}: {reason}")]
    CorruptVocabLine {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("invalid vocabulary {path}: {reason}")]
    InvalidVocab { path: PathBuf, reason: String },
    #[error("cannot load {path}")]
    TokenizerJson {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("{path} is not a byte-level BPE tokenizer: token {id} is {token:?}, which is not written in the byte-level alphabet")]
    NotByteLevel {
        path: PathBuf,
        id: u32,
        token: String,
    },
    #[error("cannot set up the BPE encoder: {0}")]
    Setup(String),
    #[error("cannot encode the text: {0}")]
    Encode(String),
    #[error("token id {id} is not in the vocabulary (vocabulary size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("the tokens decode to invalid UTF-8 (valid up to byte {valid_up_to}); decode_lossy replaces invalid sequences with U+FFFD")]
    InvalidUtf8 { valid_up_to: usize },
}

type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// A loaded tokenizer. Cheap to share (`Arc<Tokenizer>`): all methods take `&self`.
pub struct Tokenizer {
    encoder: Encoder,
    /// The bytes each id stands for, indexed by id; `None` for ids the vocabulary leaves unused.
    id_bytes: Vec<Option<Box<[u8]>>>,
    /// Added tokens by their text, for [`Tokenizer::token_id`].
    added: HashMap<String, u32>,
}

/// How text becomes ids; decoding never needs this (see `Tokenizer::id_bytes`).
enum Encoder {
    Tiktoken(Box<TiktokenEncoder>),
    /// The whole pipeline as the tokenizer.json describes it.
    HuggingFace(Box<tokenizers::Tokenizer>),
}

/// Our own added-token split and NFC, then tiktoken-rs's regex split and BPE.
struct TiktokenEncoder {
    bpe: CoreBPE,
    added: AddedTokenMatcher,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.encoder {
            Encoder::Tiktoken(_) => "tiktoken ranks",
            Encoder::HuggingFace(_) => "tokenizer.json",
        };
        f.debug_struct("Tokenizer")
            .field("source", &source)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of a model directory: `tokenizer.json` if present (that is what the
    /// published model ships), otherwise its single `*.tiktoken` file with the Qwen3.6 added tokens.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let json = dir.join("tokenizer.json");
        if json.is_file() {
            return Self::from_tokenizer_json(&json);
        }
        let entries = std::fs::read_dir(dir).map_err(|source| TokenizerError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut vocabs = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| TokenizerError::Read {
                path: dir.to_path_buf(),
                source,
            })?;
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "tiktoken") && path.is_file() {
                vocabs.push(path);
            }
        }
        match vocabs.as_slice() {
            [] => Err(TokenizerError::NotFound {
                dir: dir.to_path_buf(),
            }),
            [one] => Self::from_tiktoken_file(one),
            several => {
                let mut names: Vec<String> = several
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect();
                names.sort();
                Err(TokenizerError::AmbiguousVocab {
                    dir: dir.to_path_buf(),
                    found: names.join(", "),
                })
            }
        }
    }

    /// Loads a Hugging Face `tokenizer.json`. Only byte-level BPE vocabularies are accepted, since
    /// decoding maps every id to bytes.
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let json_error = |source| TokenizerError::TokenizerJson {
            path: path.to_path_buf(),
            source,
        };
        let mut hf = tokenizers::Tokenizer::from_file(path).map_err(json_error)?;
        // A file may carry truncation or padding settings for training; a prompt must never be
        // silently cut or padded.
        hf.with_truncation(None).map_err(json_error)?;
        hf.with_padding(None);

        let vocab = hf.get_vocab(false);
        let added_tokens = hf.get_added_tokens_decoder();
        let max_id = vocab
            .values()
            .chain(added_tokens.keys())
            .copied()
            .max()
            .unwrap_or(0);
        // The id table is a dense Vec; a file that names ids far beyond its token count is corrupt,
        // and trusting it would allocate without bound.
        let listed = vocab.len() + added_tokens.len();
        if max_id as usize >= 2 * listed {
            return Err(TokenizerError::InvalidVocab {
                path: path.to_path_buf(),
                reason: format!("token id {max_id} is far beyond the {listed} tokens listed"),
            });
        }

        let alphabet = ByteLevelAlphabet::new();
        let mut id_bytes: Vec<Option<Box<[u8]>>> = vec![None; max_id as usize + 1];
        for (token, &id) in &vocab {
            let bytes = alphabet
                .decode(token)
                .ok_or_else(|| TokenizerError::NotByteLevel {
                    path: path.to_path_buf(),
                    id,
                    token: token.clone(),
                })?;
            id_bytes[id as usize] = Some(bytes.into_boxed_slice());
        }
        // Added tokens are stored as plain text, not in the byte-level alphabet.
        let mut added = HashMap::new();
        for (&id, token) in &added_tokens {
            id_bytes[id as usize] = Some(token.content.as_bytes().into());
            added.insert(token.content.clone(), id);
        }

        Ok(Self {
            encoder: Encoder::HuggingFace(Box::new(hf)),
            id_bytes,
            added,
        })
    }

    /// Loads a tiktoken rank file (`base64(token bytes) rank` per line, ranks 0..n without gaps)
    /// and adds the 33 Qwen3.6 [`ADDED_TOKENS`] as ids n, n+1, …; for the real Qwen3.6 file n is
    /// 248,044. Encoding uses [`SPLIT_PATTERN`] and NFC, as the Qwen3.5/3.6 tokenizer does.
    pub fn from_tiktoken_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|source| TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let ranks = parse_tiktoken(&data).map_err(|e| match e {
            ParseError::Line { line, reason } => TokenizerError::CorruptVocabLine {
                path: path.to_path_buf(),
                line,
                reason,
            },
            ParseError::Whole(reason) => TokenizerError::InvalidVocab {
                path: path.to_path_buf(),
                reason,
            },
        })?;
        Self::from_ranks(ranks)
    }

    /// A Qwen3.5/3.6 vocabulary listed as token strings by id, as GGUF files carry it
    /// (`tokenizer.ggml.tokens`): the byte-level BPE tokens in rank order (for Qwen, id = BPE
    /// rank, as in the tiktoken file), then the [`ADDED_TOKENS`] in order, then possibly padding
    /// entries up to the model's vocabulary size, which are ignored. `source` names the file in
    /// errors.
    pub fn from_token_list(tokens: &[String], source: &Path) -> Result<Self> {
        let invalid = |reason: String| TokenizerError::InvalidVocab {
            path: source.to_path_buf(),
            reason,
        };
        let first_added = tokens
            .iter()
            .position(|t| t == ADDED_TOKENS[0])
            .ok_or_else(|| {
                invalid(format!(
                    "no `{}` token: not a Qwen3.5/3.6 vocabulary",
                    ADDED_TOKENS[0]
                ))
            })?;
        let added = tokens.get(first_added..first_added + ADDED_TOKENS.len());
        if added != Some(&ADDED_TOKENS.map(String::from)[..]) {
            return Err(invalid(format!(
                "the tokens from id {first_added} on are not Qwen3.6's {} added tokens in order",
                ADDED_TOKENS.len()
            )));
        }
        let alphabet = ByteLevelAlphabet::new();
        let ranks = tokens[..first_added]
            .iter()
            .enumerate()
            .map(|(id, token)| {
                alphabet
                    .decode(token)
                    .ok_or_else(|| TokenizerError::NotByteLevel {
                        path: source.to_path_buf(),
                        id: id as u32,
                        token: token.clone(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_ranks(ranks)
    }

    /// A small real byte-level BPE for the built-in demo model, whose vocabulary must be
    /// [`DEMO_VOCAB_SIZE`] (512): the 256 bytes, 223 merges learnt from a short built-in English
    /// text, then the 33 [`ADDED_TOKENS`] (so `<|im_end|>` is 481 here, not 248046). Any text
    /// encodes (every byte is a token), and it encodes the way the real one does: added tokens
    /// first, NFC, [`SPLIT_PATTERN`], BPE.
    pub fn byte_level_demo() -> Result<Self> {
        let mut ranks: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        ranks.extend(learn_merges(DEMO_TRAINING_TEXT, DEMO_MERGES));
        Self::from_ranks(ranks)
    }

    /// Builds the tiktoken-style tokenizer from token bytes indexed by rank (= id).
    fn from_ranks(ranks: Vec<Vec<u8>>) -> Result<Self> {
        let first_added = ranks.len();
        let added: HashMap<String, u32> = ADDED_TOKENS
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), (first_added + i) as u32))
            .collect();

        let mut id_bytes: Vec<Option<Box<[u8]>>> = ranks
            .iter()
            .map(|bytes| Some(bytes.as_slice().into()))
            .collect();
        id_bytes.extend(ADDED_TOKENS.iter().map(|t| Some(t.as_bytes().into())));

        let encoder: FxHashMap<Vec<u8>, u32> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, bytes)| (bytes, rank as u32))
            .collect();
        // CoreBPE also learns the added tokens, though we cut them out before it sees the text:
        // its encode() needs a well-formed special-token regex (an empty one would match
        // everywhere).
        let specials: FxHashMap<String, u32> =
            added.iter().map(|(t, &id)| (t.clone(), id)).collect();
        let bpe = CoreBPE::new(encoder, specials, SPLIT_PATTERN)
            .map_err(|e| TokenizerError::Setup(e.to_string()))?;

        Ok(Self {
            encoder: Encoder::Tiktoken(Box::new(TiktokenEncoder {
                bpe,
                added: AddedTokenMatcher::new(&added),
            })),
            id_bytes,
            added,
        })
    }

    /// Encodes text into token ids. Added tokens are recognised anywhere in the text; no BOS or
    /// EOS is added (the chat template writes every special token itself).
    ///
    /// Fails only if the tokenizing machinery reports an error (tiktoken's regex engine hitting
    /// its backtracking limit, say); it never panics on any input.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.encoder {
            Encoder::HuggingFace(hf) => hf
                .encode_fast(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode(e.to_string())),
            Encoder::Tiktoken(tiktoken) => {
                // No added token is "allowed" inside the pieces: they were all cut out already.
                let none_allowed = HashSet::new();
                let mut ids = Vec::new();
                for piece in tiktoken.added.split(text) {
                    match piece {
                        Piece::Added(id) => ids.push(id),
                        Piece::Text(text) => {
                            let (piece_ids, _) = tiktoken
                                .bpe
                                .encode(&nfc(text), &none_allowed)
                                .map_err(|e| TokenizerError::Encode(e.message))?;
                            ids.extend(piece_ids);
                        }
                    }
                }
                Ok(ids)
            }
        }
    }

    /// The bytes one id stands for. They are not necessarily valid UTF-8 on their own.
    pub fn token_to_bytes(&self, id: u32) -> Result<&[u8]> {
        self.id_bytes
            .get(id as usize)
            .and_then(|bytes| bytes.as_deref())
            .ok_or(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.vocab_size(),
            })
    }

    /// The concatenated bytes of `ids`.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.token_to_bytes(id)?);
        }
        Ok(bytes)
    }

    /// Decodes `ids` to text; fails if the bytes are not valid UTF-8 (for instance when a
    /// character's bytes are cut off at the end). See [`Tokenizer::decode_lossy`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        String::from_utf8(self.decode_bytes(ids)?).map_err(|e| TokenizerError::InvalidUtf8 {
            valid_up_to: e.utf8_error().valid_up_to(),
        })
    }

    /// Decodes `ids` to text, replacing each invalid UTF-8 sequence with U+FFFD (as
    /// `String::from_utf8_lossy` does). Unknown ids are still an error.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// Number of ids: one more than the largest id (for Qwen3.6, 248,077). Model vocabularies can
    /// be larger (Qwen3.6's embedding has 248,320 rows); ids at or beyond this size cannot be
    /// decoded, so the sampler must never produce them.
    pub fn vocab_size(&self) -> usize {
        self.id_bytes.len()
    }

    /// The id of an added token such as `<|im_end|>` or `<think>`; `None` for any other string.
    pub fn token_id(&self, added_token: &str) -> Option<u32> {
        self.added.get(added_token).copied()
    }
}

/// Applies NFC, borrowing when the text is already normalised (the common case).
fn nfc(text: &str) -> Cow<'_, str> {
    if is_nfc_quick(text.chars()) == IsNormalized::Yes {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(text.nfc().collect())
    }
}

/// A stretch of input: ordinary text, or an added token found in it.
#[derive(Debug, PartialEq)]
enum Piece<'t> {
    Text(&'t str),
    Added(u32),
}

/// Finds added tokens in text: leftmost first, longest at a given position (as Hugging Face's
/// added-vocabulary matcher does).
struct AddedTokenMatcher {
    /// Longest first, so the first hit at a position is the longest.
    tokens: Vec<(String, u32)>,
    /// Which bytes start some added token: a cheap filter before comparing strings.
    first_bytes: [bool; 256],
}

impl AddedTokenMatcher {
    fn new(added: &HashMap<String, u32>) -> Self {
        let mut tokens: Vec<(String, u32)> = added
            .iter()
            .filter(|(text, _)| !text.is_empty())
            .map(|(text, &id)| (text.clone(), id))
            .collect();
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        let mut first_bytes = [false; 256];
        for (text, _) in &tokens {
            first_bytes[text.as_bytes()[0] as usize] = true;
        }
        Self {
            tokens,
            first_bytes,
        }
    }

    fn split<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let mut pieces = Vec::new();
        let mut text_start = 0; // start of ordinary text not yet emitted
        let mut pos = 0; // always on a char boundary
        while let Some(c) = text[pos..].chars().next() {
            match self.match_at(&text[pos..]) {
                Some((len, id)) => {
                    if text_start < pos {
                        pieces.push(Piece::Text(&text[text_start..pos]));
                    }
                    pieces.push(Piece::Added(id));
                    pos += len; // a whole token string: still a char boundary
                    text_start = pos;
                }
                None => pos += c.len_utf8(),
            }
        }
        if text_start < text.len() {
            pieces.push(Piece::Text(&text[text_start..]));
        }
        pieces
    }

    /// The (byte length, id) of the longest added token that `rest` starts with.
    fn match_at(&self, rest: &str) -> Option<(usize, u32)> {
        let first = *rest.as_bytes().first()?;
        if !self.first_bytes[first as usize] {
            return None;
        }
        self.tokens
            .iter()
            .find(|(token, _)| rest.starts_with(token.as_str()))
            .map(|(token, id)| (token.len(), *id))
    }
}

/// Why a tiktoken file was rejected; turned into a [`TokenizerError`] naming the file.
enum ParseError {
    Line { line: usize, reason: String },
    Whole(String),
}

/// Parses `base64(token bytes) rank` lines into token bytes indexed by rank. Blank lines are
/// skipped (as Python tiktoken does). Ranks must be unique and cover 0..n, because they are the
/// token ids; duplicate tokens are rejected too.
fn parse_tiktoken(data: &[u8]) -> Result<Vec<Vec<u8>>, ParseError> {
    let mut by_rank: BTreeMap<u32, (Vec<u8>, usize)> = BTreeMap::new();
    let mut rank_of_token: HashMap<Vec<u8>, usize> = HashMap::new();
    for (index, raw) in data.split(|&b| b == b'\n').enumerate() {
        let line = index + 1;
        let fail = |reason: String| ParseError::Line { line, reason };
        let text = std::str::from_utf8(raw)
            .map_err(|_| fail("not UTF-8 text".into()))?
            .trim();
        if text.is_empty() {
            continue;
        }
        let fields: Vec<&str> = text.split_ascii_whitespace().collect();
        let [token_b64, rank] = fields[..] else {
            return Err(fail(format!(
                "expected `<base64 token> <rank>`, found {} field(s)",
                fields.len()
            )));
        };
        let token = base64::engine::general_purpose::STANDARD
            .decode(token_b64)
            .map_err(|e| fail(format!("token {token_b64:?} is not valid base64: {e}")))?;
        if token.is_empty() {
            return Err(fail("empty token".into()));
        }
        let rank: u32 = rank
            .parse()
            .map_err(|_| fail(format!("rank {rank:?} is not a non-negative integer")))?;
        if let Some((_, first_line)) = by_rank.get(&rank) {
            return Err(fail(format!(
                "rank {rank} was already given on line {first_line}"
            )));
        }
        if let Some(first_line) = rank_of_token.insert(token.clone(), line) {
            return Err(fail(format!(
                "token {token_b64} was already given on line {first_line}"
            )));
        }
        by_rank.insert(rank, (token, line));
    }

    let count = by_rank.len();
    if count == 0 {
        return Err(ParseError::Whole("no tokens".into()));
    }
    // Ranks are unique, so they cover 0..count exactly when the largest is count - 1.
    if let Some((&rank, (_, line))) = by_rank.last_key_value() {
        if rank as usize >= count {
            return Err(ParseError::Line {
                line: *line,
                reason: format!(
                    "rank {rank} leaves gaps: {count} tokens need ranks 0..={}",
                    count - 1
                ),
            });
        }
    }
    Ok(by_rank.into_values().map(|(token, _)| token).collect())
}

/// GPT-2's byte-level alphabet, in which tokenizer.json vocabularies write token bytes: each byte
/// is one printable char. Bytes that are printable Latin-1 stand for themselves; the other 68
/// (controls, space, DEL, NBSP, soft hyphen…) are written as U+0100, U+0101, … in byte order.
struct ByteLevelAlphabet {
    /// Indexed by char code (< 256 + 68): the byte that char stands for.
    byte_of_char: [Option<u8>; 256 + 68],
}

impl ByteLevelAlphabet {
    fn new() -> Self {
        let mut byte_of_char = [None; 256 + 68];
        let mut next_stand_in = 256;
        for byte in 0..=255u8 {
            let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            if printable {
                byte_of_char[byte as usize] = Some(byte);
            } else {
                byte_of_char[next_stand_in] = Some(byte);
                next_stand_in += 1;
            }
        }
        Self { byte_of_char }
    }

    /// The bytes a vocabulary string stands for, or `None` if it uses a char outside the alphabet.
    fn decode(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| *self.byte_of_char.get(c as usize)?)
            .collect()
    }
}

/// Learns `count` BPE merges from `text`, the classic way: split the text into words, start from
/// single bytes, and repeatedly merge the most frequent adjacent pair (ties: the smallest pair of
/// ids, so the result is deterministic). Returns the bytes of the new tokens in the order learnt,
/// which is their rank order.
fn learn_merges(text: &str, count: usize) -> Vec<Vec<u8>> {
    // Each distinct word as a sequence of token ids, with its number of occurrences.
    let mut word_counts: BTreeMap<&[u8], usize> = BTreeMap::new();
    for word in training_words(text) {
        *word_counts.entry(word.as_bytes()).or_default() += 1;
    }
    let mut words: Vec<(Vec<u32>, usize)> = word_counts
        .into_iter()
        .map(|(bytes, n)| (bytes.iter().map(|&b| u32::from(b)).collect(), n))
        .collect();

    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut id_of: HashMap<Vec<u8>, u32> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();

    while tokens.len() < 256 + count {
        let mut pair_counts: BTreeMap<(u32, u32), usize> = BTreeMap::new();
        for (ids, n) in &words {
            for pair in ids.windows(2) {
                *pair_counts.entry((pair[0], pair[1])).or_default() += n;
            }
        }
        // Highest count; among equals the first (smallest) pair, since max_by_key keeps the last.
        let Some((&(left, right), _)) = pair_counts.iter().rev().max_by_key(|(_, &n)| n) else {
            break; // every word is a single token: nothing left to learn
        };
        let merged = [tokens[left as usize].as_slice(), &tokens[right as usize]].concat();
        // Two different pairs can spell the same bytes ("a"+"bc", "ab"+"c"); they share one token.
        let merged_id = *id_of.entry(merged.clone()).or_insert_with(|| {
            tokens.push(merged);
            (tokens.len() - 1) as u32
        });
        for (ids, _) in &mut words {
            let mut out = Vec::with_capacity(ids.len());
            let mut i = 0;
            while i < ids.len() {
                if i + 1 < ids.len() && ids[i] == left && ids[i + 1] == right {
                    out.push(merged_id);
                    i += 2;
                } else {
                    out.push(ids[i]);
                    i += 1;
                }
            }
            *ids = out;
        }
    }
    tokens.split_off(256)
}

/// Splits training text roughly the way [`SPLIT_PATTERN`] splits input, so the learnt merges are
/// ones encoding can use: a space joins the letters after it (" word"), digits stand alone, other
/// characters form runs.
fn training_words(text: &str) -> Vec<&str> {
    #[derive(PartialEq, Clone, Copy)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    let class = |c: char| {
        if c.is_alphabetic() {
            Class::Letter
        } else if c.is_numeric() {
            Class::Digit
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        }
    };
    let mut words = Vec::new();
    let mut start = 0;
    let mut prev: Option<char> = None;
    for (i, c) in text.char_indices() {
        if let Some(p) = prev {
            let joins = match (class(p), class(c)) {
                (Class::Digit, _) | (_, Class::Digit) => false,
                // " word": a single space leads the letters that follow it.
                (Class::Space, Class::Letter) => p == ' ' && (i - start) == 1,
                (a, b) => a == b,
            };
            if !joins {
                words.push(&text[start..i]);
                start = i;
            }
        }
        prev = Some(c);
    }
    if start < text.len() {
        words.push(&text[start..]);
    }
    words
}

/// The text the demo tokenizer learns its merges from: common English and the words of a chat.
const DEMO_TRAINING_TEXT: &str = "\
You are a helpful assistant. The user asks a question and the assistant answers it. \
The assistant thinks about the question first, then it writes the answer. \
Hello! How are you today? I am fine, thank you. What is the weather like in the city? \
It is sunny and warm, with a light wind from the west. Tomorrow there will be some rain. \
Can you help me write a short story about a small robot that wants to learn how to paint? \
Once upon a time there was a small robot. Every morning the robot looked at the sky and \
wondered what colours the world would have if it could paint them. One day it found an old \
box of paints in the garden, and it started to paint the flowers, the trees and the river. \
The other robots laughed at first, but when they saw the pictures they wanted to learn too. \
Please explain how a computer works. A computer reads instructions from memory and runs them \
one after another. The processor does the work, the memory holds the data, and the program \
tells the processor what to do. When you type on the keyboard, the computer reads the keys and \
shows the letters on the screen. Programs are written in languages such as Python or Rust. \
def add(a, b):\n    return a + b\n\nfn main() {\n    let total = add(1, 2);\n    println!(\"{}\", total);\n}\n\
The answer is that this is the thing which they have been looking for in the other place, \
and there is nothing more that we should do about it here, because the work is done. \
Thank you for your question. Let me think about it step by step, and then I will give you \
the answer. First, we look at the information we have. Second, we think about what it means. \
Finally, we write down the result and check that it is correct.\n";

/// Turns token ids into text one token at a time, for streaming.
///
/// A UTF-8 character can be split across tokens (CJK and emoji usually are in byte-level BPE),
/// so bytes that begin a character are held back until it is complete; the text returned by
/// [`IncrementalDecoder::push`] is always whole characters. Bytes that can never become valid
/// UTF-8 are replaced by U+FFFD at once, one per invalid sequence. The deltas of all pushes plus
/// [`IncrementalDecoder::finish`] concatenate to exactly [`Tokenizer::decode_lossy`] of all ids.
///
/// The decoder holds no reference to the tokenizer, so it can live in a per-sequence state.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    /// The start of an incomplete character (at most 3 bytes).
    held: Vec<u8>,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the text it completes (possibly empty). An unknown id is an
    /// error and leaves the decoder unchanged.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.held.extend_from_slice(tokenizer.token_to_bytes(id)?);
        let mut text = String::new();
        let mut consumed = 0;
        for chunk in self.held.utf8_chunks() {
            text.push_str(chunk.valid());
            consumed += chunk.valid().len();
            let invalid = chunk.invalid();
            // An incomplete character at the very end may still be completed by the next token;
            // anything else that is invalid stays invalid whatever follows.
            let at_end = consumed + invalid.len() == self.held.len();
            if at_end && is_incomplete_char(invalid) {
                break;
            }
            if !invalid.is_empty() {
                text.push(char::REPLACEMENT_CHARACTER);
            }
            consumed += invalid.len();
        }
        self.held.drain(..consumed);
        Ok(text)
    }

    /// Ends the stream: bytes still held back (a character cut off by the last token) come out as
    /// U+FFFD. The decoder is then empty and can be reused.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.held).into_owned();
        self.held.clear();
        text
    }
}

/// Whether `bytes` is the start of a valid UTF-8 character that needs more bytes.
fn is_incomplete_char(bytes: &[u8]) -> bool {
    !bytes.is_empty() && matches!(std::str::from_utf8(bytes), Err(e) if e.error_len().is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn added_tokens_are_cut_out_leftmost_longest() {
        let added: HashMap<String, u32> = [("<a>", 1), ("<ab>", 2), ("<a", 3)]
            .into_iter()
            .map(|(t, id)| (t.to_string(), id))
            .collect();
        let matcher = AddedTokenMatcher::new(&added);
        assert_eq!(
            matcher.split("x<ab>é<a><a"),
            vec![
                Piece::Text("x"),
                Piece::Added(2),
                Piece::Text("é"),
                Piece::Added(1),
                Piece::Added(3)
            ]
        );
        assert_eq!(matcher.split(""), vec![]);
        assert_eq!(matcher.split("plain"), vec![Piece::Text("plain")]);
    }

    #[test]
    fn byte_level_alphabet_round_trips_every_byte() {
        let alphabet = ByteLevelAlphabet::new();
        // "Ġ" (U+0120) is the space, "Ċ" (U+010A) the newline, as in every GPT-2 style vocabulary.
        assert_eq!(alphabet.decode("Ġthe"), Some(b" the".to_vec()));
        assert_eq!(alphabet.decode("Ċ"), Some(b"\n".to_vec()));
        assert_eq!(alphabet.decode("\u{00AD}"), None);
        let seen: HashSet<u8> = alphabet.byte_of_char.iter().flatten().copied().collect();
        assert_eq!(seen.len(), 256);
    }

    /// The demo vocabulary written as a GGUF token list (byte-level strings, added tokens, padding)
    /// reads back as the same tokenizer.
    #[test]
    fn token_lists_read_like_gguf_writes_them() {
        let demo = Tokenizer::byte_level_demo().unwrap();
        let alphabet = ByteLevelAlphabet::new();
        let char_of = |b: u8| {
            let code = alphabet.byte_of_char.iter().position(|&x| x == Some(b));
            char::from_u32(code.unwrap() as u32).unwrap()
        };
        let bpe = DEMO_VOCAB_SIZE - ADDED_TOKENS.len();
        let mut tokens: Vec<String> = (0..bpe)
            .map(|id| {
                demo.id_bytes[id]
                    .as_ref()
                    .unwrap()
                    .iter()
                    .map(|&b| char_of(b))
                    .collect()
            })
            .collect();
        tokens.extend(ADDED_TOKENS.iter().map(|t| t.to_string()));
        tokens.extend((0..5).map(|i| format!("[PAD{}]", DEMO_VOCAB_SIZE + i)));
        let path = Path::new("model.gguf");
        let read = Tokenizer::from_token_list(&tokens, path).unwrap();
        let text = "Hello <|im_start|>wörld\n\n  42 tokens<think>é</think>";
        assert_eq!(read.encode(text).unwrap(), demo.encode(text).unwrap());
        assert_eq!(read.vocab_size(), DEMO_VOCAB_SIZE);
        assert_eq!(read.token_id("<|im_end|>"), demo.token_id("<|im_end|>"));

        let mut shuffled = tokens.clone();
        shuffled.swap(bpe + 1, bpe + 2);
        let e = Tokenizer::from_token_list(&shuffled, path).unwrap_err();
        assert!(e.to_string().contains("added tokens in order"), "{e}");
        let e = Tokenizer::from_token_list(&tokens[..bpe], path).unwrap_err();
        assert!(
            e.to_string().contains("not a Qwen3.5/3.6 vocabulary"),
            "{e}"
        );
    }

    #[test]
    fn training_words_split_like_the_pre_tokenizer() {
        assert_eq!(
            training_words("Hi there, 42 ok.\n"),
            vec!["Hi", " there", ",", " ", "4", "2", " ok", ".", "\n"]
        );
    }

    #[test]
    fn learn_merges_picks_the_most_frequent_pair_first() {
        let merges = learn_merges("ab ab ab cd", 2);
        assert_eq!(merges[0], b"ab".to_vec());
        assert_eq!(merges[1], b" ab".to_vec());
    }
}
