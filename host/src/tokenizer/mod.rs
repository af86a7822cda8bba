//! Text ⇄ token ids, incremental detokenization and chat templates.
//!
//! [`Tokenizer`] is built either from the tokenizer metadata embedded in a
//! GGUF file ([`Tokenizer::from_gguf`]) or from a Hugging Face model folder
//! ([`Tokenizer::from_hf_dir`]). Both end up as a `tokenizers::Tokenizer`
//! plus the model's special-token configuration (BOS/EOS ids, whether BOS is
//! prepended, the chat template).
//!
//! From GGUF, two tokenizer families are supported:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE with explicit merges.
//!   The text is first split by a pre-tokenizer regex chosen by
//!   `tokenizer.ggml.pre` (see [`pre_tokenizer_regexes`]);
//! - `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE. Merges are
//!   derived from the token scores (a pair merges with the priority of the
//!   score of the token it forms), spaces become `▁`, and characters outside
//!   the vocabulary fall back to `<0xNN>` byte tokens.

pub mod chat_template;
pub mod detokenizer;
pub mod plain_text;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use detokenizer::IncrementalDetokenizer;

use crate::engine::loader::gguf::GgufFile;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;
use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Replace, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// GGUF `tokenizer.ggml.token_type` values.
mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
}

/// GPT-2's pre-tokenizer: contractions, letters, numbers and other symbols,
/// each optionally with one leading space, then runs of whitespace.
const REGEX_GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's pre-tokenizer: case-insensitive contractions, words with one
/// optional leading non-letter, numbers in groups of up to three digits.
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's pre-tokenizer: as Llama 3's, but every digit on its own.
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken pre-tokenizer: words split at case changes, single digits.
const REGEX_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a byte-level BPE vocabulary splits text before BPE runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PreTokenizerSpec {
    /// Split every digit into its own piece first.
    individual_digits: bool,
    /// The regex whose matches become the pieces.
    regex: &'static str,
    /// A whole piece that is itself in the vocabulary is used as is.
    ignore_merges: bool,
    /// Apply NFC normalization first.
    nfc: bool,
}

/// The pre-tokenizer for GGUF's `tokenizer.ggml.pre` value, or `None` if it
/// is not one we know.
fn pre_tokenizer_spec(pre: &str) -> Option<PreTokenizerSpec> {
    let spec = |individual_digits, regex, ignore_merges, nfc| PreTokenizerSpec {
        individual_digits,
        regex,
        ignore_merges,
        nfc,
    };
    Some(match pre {
        "gpt2" | "default" | "gpt-2" | "phi-2" | "olmo" | "jina-es" | "jina-de" | "poro-chat"
        | "viking" | "jais" => spec(false, REGEX_GPT2, false, false),
        "smollm" | "starcoder" | "refact" | "codeshell" => spec(true, REGEX_GPT2, false, false),
        "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "dbrx" => {
            spec(false, REGEX_LLAMA3, true, false)
        }
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => {
            spec(false, REGEX_QWEN2, false, true)
        }
        "tekken" | "mistral" => spec(false, REGEX_TEKKEN, false, false),
        _ => return None,
    })
}

/// The pre-tokenizer regexes Pagoda knows, by `tokenizer.ggml.pre` name
/// (one representative name per regex), for documentation and tests.
pub fn pre_tokenizer_regexes() -> Vec<(&'static str, &'static str)> {
    vec![
        ("gpt2", REGEX_GPT2),
        ("llama-bpe", REGEX_LLAMA3),
        ("qwen2", REGEX_QWEN2),
        ("tekken", REGEX_TEKKEN),
    ]
}

/// GPT-2's byte-level alphabet inverted: the character each byte is
/// written as in a byte-level vocabulary, mapped back to the byte.
/// Printable Latin-1 bytes stand for themselves; the others are shifted
/// to U+0100 and up, in byte order.
fn byte_level_inverse() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
        map.insert(c, b);
    }
    map
}

fn tk_err(e: tokenizers::Error) -> anyhow::Error {
    anyhow!("{e}")
}

/// A model's tokenizer: encoding, decoding and its special tokens.
///
/// Cheap to share: wrap it in an `Arc` (it is `Send + Sync`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: bool,
    special: HashSet<u32>,
    chat_template: Option<ChatTemplate>,
    /// The same tokenizer with special-token text encoded as plain text,
    /// for text a client wrote (built on first use).
    text_only: OnceLock<tokenizers::Tokenizer>,
    /// The texts of the special tokens (built on first use).
    special_texts: OnceLock<Vec<String>>,
    /// The longest text one token decodes to, in bytes (on first use).
    max_token_bytes: OnceLock<usize>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Parses one `"left right"` merge rule.
fn split_merge(rule: &str, i: usize) -> Result<(String, String)> {
    let (a, b) = rule
        .split_once(' ')
        .ok_or_else(|| anyhow!("merge rule {i} {rule:?} is not two tokens separated by a space"))?;
    Ok((a.to_owned(), b.to_owned()))
}

/// A vocabulary map from token text to id; on duplicate texts the first id
/// wins (the later duplicates can still be decoded but never produced).
fn vocab_map(tokens: &[&str]) -> tokenizers::models::bpe::Vocab {
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (id, t) in tokens.iter().enumerate() {
        vocab.entry((*t).to_owned()).or_insert(id as u32);
    }
    vocab
}

/// SentencePiece BPE merges derived from token scores: every way of writing
/// a normal token as the concatenation of two normal tokens is a merge, and
/// merges that form higher-scoring tokens come first.
fn merges_from_scores(tokens: &[&str], scores: &[f32], types: &[i32]) -> Vec<(String, String)> {
    let is_normal = |id: usize| {
        matches!(
            types.get(id).copied().unwrap_or(token_type::NORMAL),
            token_type::NORMAL | token_type::USER_DEFINED
        )
    };
    let mut index = std::collections::HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        if is_normal(id) {
            index.entry(*t).or_insert(id);
        }
    }
    // (score of the merged token, merged id, left id, right id)
    let mut found: Vec<(f32, usize, usize, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if !is_normal(id) || t.chars().nth(1).is_none() {
            continue;
        }
        for (split, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(split);
            if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                let score = scores.get(id).copied().unwrap_or(0.0);
                found.push((score, id, li, ri));
            }
        }
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    found
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l].to_owned(), tokens[r].to_owned()))
        .collect()
}

/// The token text of a `"bos_token"`-style entry of `tokenizer_config.json`:
/// a plain string or an object with `content`.
fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The chat template of a `tokenizer_config.json`'s `chat_template`: a
/// string, or a list of `{name, template}` (the one named `default`, else
/// the first).
fn template_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |want: Option<&str>| {
                list.iter().find_map(|e| {
                    let name = e.get("name")?.as_str()?;
                    if want.is_none_or(|w| w == name) {
                        e.get("template")?.as_str().map(str::to_owned)
                    } else {
                        None
                    }
                })
            };
            named(Some("default")).or_else(|| named(None))
        }
        _ => None,
    }
}

/// Reads an optional JSON file of a model folder.
fn read_json(path: &Path) -> Result<Option<Json>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .with_context(|| format!("{}: invalid JSON", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("{}: cannot read", path.display())),
    }
}

/// The ids in a `generation_config.json` field: an integer or a list.
fn json_ids(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Json::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata.
    ///
    /// `tokenizer.ggml.model` selects the family: `"gpt2"` is byte-level BPE
    /// with `tokenizer.ggml.merges` and the pre-tokenizer named by
    /// `tokenizer.ggml.pre` (unknown names fall back to GPT-2's, with a
    /// warning); `"llama"` is SentencePiece-style BPE over
    /// `tokenizer.ggml.scores` with `<0xNN>` byte fallback. Control and unknown
    /// tokens (token types 3 and 2) become special tokens and user-defined tokens (type 4)
    /// added tokens, so text such as `<|im_start|>` encodes as one token.
    /// BOS/EOS come from `tokenizer.ggml.{bos,eos,eot,eom}_token_id`, whether
    /// BOS is prepended from `tokenizer.ggml.add_bos_token`, and the chat
    /// template from `tokenizer.chat_template`.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let shown = g.path().display();
        Self::build_from_gguf(g).with_context(|| format!("{shown}: cannot build the tokenizer"))
    }

    fn build_from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let model = g
            .get_str("tokenizer.ggml.model")?
            .ok_or_else(|| anyhow!("metadata key 'tokenizer.ggml.model' is missing"))?;
        let tokens = g
            .get_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| anyhow!("metadata key 'tokenizer.ggml.tokens' is missing"))?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            bail!("tokenizer.ggml.tokens has {} entries", tokens.len());
        }
        let types = g
            .get_i32_array("tokenizer.ggml.token_type")?
            .unwrap_or_else(|| vec![token_type::NORMAL; tokens.len()]);
        if types.len() != tokens.len() {
            bail!(
                "tokenizer.ggml.token_type has {} entries but there are {} tokens",
                types.len(),
                tokens.len()
            );
        }
        let id_key = |key: &str| -> Result<Option<u32>> {
            match g.get_u32(key)? {
                Some(id) if (id as usize) < tokens.len() => Ok(Some(id)),
                Some(id) => bail!("{key} = {id} is outside the vocabulary of {}", tokens.len()),
                None => Ok(None),
            }
        };
        let bos_id = id_key("tokenizer.ggml.bos_token_id")?;
        let eos_id = id_key("tokenizer.ggml.eos_token_id")?;
        let mut eos_ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = id_key(key)? {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }

        let (mut inner, default_add_bos) = match model {
            "gpt2" => {
                let merges = g
                    .get_str_array("tokenizer.ggml.merges")?
                    .ok_or_else(|| anyhow!("a gpt2 tokenizer needs 'tokenizer.ggml.merges'"))?;
                let pre = g.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
                (Self::byte_level_bpe(&tokens, &merges, pre)?, false)
            }
            "llama" => {
                let scores = g
                    .get_f32_array("tokenizer.ggml.scores")?
                    .ok_or_else(|| anyhow!("a llama tokenizer needs 'tokenizer.ggml.scores'"))?;
                if scores.len() != tokens.len() {
                    bail!(
                        "tokenizer.ggml.scores has {} entries but there are {} tokens",
                        scores.len(),
                        tokens.len()
                    );
                }
                let add_space_prefix = g
                    .get_bool("tokenizer.ggml.add_space_prefix")?
                    .unwrap_or(true);
                (
                    Self::sentencepiece_bpe(&tokens, &scores, &types, add_space_prefix)?,
                    true,
                )
            }
            other => bail!("tokenizer model '{other}' is not supported (only gpt2 and llama)"),
        };

        // Control and unknown tokens are special (matched in text, left out
        // by `decode(…, skip_special = true)`); user-defined tokens are
        // matched in text as one token but kept when decoding, as in
        // llama.cpp and for HF's non-special added tokens.
        let mut special = HashSet::new();
        let mut added = Vec::new();
        for (id, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
            if text.is_empty() {
                continue;
            }
            match ty {
                token_type::CONTROL | token_type::UNKNOWN => {
                    special.insert(id as u32);
                    added.push(AddedToken::from(text, true).normalized(false));
                }
                token_type::USER_DEFINED => {
                    added.push(AddedToken::from(text, false).normalized(false));
                }
                _ => {}
            }
        }
        // The texts are already in the model's vocabulary, so adding them
        // keeps their ids (on duplicate texts, the first id).
        inner.add_tokens(&added);

        let add_bos = g
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(default_add_bos);
        let bos_token = bos_id.map(|i| tokens[i as usize].to_owned());
        let eos_token = eos_id.map(|i| tokens[i as usize].to_owned());
        let chat_template = match g.get_str("tokenizer.chat_template")? {
            Some(src) => Some(
                ChatTemplate::new(src, bos_token.as_deref(), eos_token.as_deref())
                    .context("tokenizer.chat_template")?,
            ),
            None => None,
        };
        Ok(Tokenizer {
            inner,
            vocab_size: tokens.len(),
            bos_id,
            eos_ids,
            bos_token,
            eos_token,
            add_bos,
            special,
            chat_template,
            text_only: OnceLock::new(),
            special_texts: OnceLock::new(),
            max_token_bytes: OnceLock::new(),
        })
    }

    /// Byte-level BPE (GPT-2 style) with the pre-tokenizer named `pre`.
    fn byte_level_bpe(
        tokens: &[&str],
        merges: &[&str],
        pre: &str,
    ) -> Result<tokenizers::Tokenizer> {
        let spec = pre_tokenizer_spec(pre).unwrap_or_else(|| {
            tracing::warn!(
                "tokenizer.ggml.pre '{pre}' is not known; falling back to the GPT-2 pre-tokenizer, so tokenization may differ from the model's own"
            );
            pre_tokenizer_spec("gpt2").unwrap_or(PreTokenizerSpec {
                individual_digits: false,
                regex: REGEX_GPT2,
                ignore_merges: false,
                nfc: false,
            })
        });
        let merges = merges
            .iter()
            .enumerate()
            .map(|(i, m)| split_merge(m, i))
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab_map(tokens), merges)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(tk_err)
            .context("cannot build the BPE model")?;
        let mut t = tokenizers::Tokenizer::new(bpe);
        let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
        if spec.individual_digits {
            steps.push(Digits::new(true).into());
        }
        let split = Split::new(
            SplitPattern::Regex(spec.regex.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tk_err)
        .context("cannot compile the pre-tokenizer regex")?;
        steps.push(split.into());
        steps.push(ByteLevel::new(false, false, false).into());
        t.with_pre_tokenizer(Some(PreTokenizerSequence::new(steps)));
        t.with_decoder(Some(ByteLevel::new(false, false, false)));
        if spec.nfc {
            t.with_normalizer(Some(NFC));
        }
        Ok(t)
    }

    /// SentencePiece-style BPE: merges from scores, `▁` for spaces, byte fallback.
    fn sentencepiece_bpe(
        tokens: &[&str],
        scores: &[f32],
        types: &[i32],
        add_space_prefix: bool,
    ) -> Result<tokenizers::Tokenizer> {
        let merges = merges_from_scores(tokens, scores, types);
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab_map(tokens), merges)
            .byte_fallback(true)
            .fuse_unk(true);
        if let Some(unk) = types.iter().position(|&t| t == token_type::UNKNOWN) {
            builder = builder.unk_token(tokens[unk].to_owned());
        }
        let bpe = builder
            .build()
            .map_err(tk_err)
            .context("cannot build the BPE model")?;
        let mut t = tokenizers::Tokenizer::new(bpe);
        let scheme = if add_space_prefix {
            PrependScheme::First
        } else {
            PrependScheme::Never
        };
        t.with_pre_tokenizer(Some(Metaspace::new('▁', scheme, false)));
        let mut steps: Vec<DecoderWrapper> = vec![
            Replace::new("▁", " ").map_err(tk_err)?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if add_space_prefix {
            steps.push(Strip::new(' ', 1, 0).into());
        }
        t.with_decoder(Some(DecoderSequence::new(steps)));
        Ok(t)
    }

    /// Loads the tokenizer of a Hugging Face model folder: `tokenizer.json`,
    /// plus `tokenizer_config.json` (`chat_template` as a string or a list of
    /// named templates, `bos_token`/`eos_token` as strings or `{content}`
    /// objects, `add_bos_token`), `chat_template.jinja` if the config has no
    /// template, and `generation_config.json` (`eos_token_id` as an integer or
    /// a list, `bos_token_id`). Without `add_bos_token`, BOS is prepended if
    /// the tokenizer's own post-processor would add it.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let shown = dir.display();
        Self::build_from_hf_dir(dir)
            .with_context(|| format!("{shown}: cannot load the Hugging Face tokenizer"))
    }

    fn build_from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let tj = dir.join("tokenizer.json");
        let inner =
            tokenizers::Tokenizer::from_file(&tj).map_err(|e| anyhow!("{}: {e}", tj.display()))?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
        let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);

        let mut special = HashSet::new();
        for (id, t) in inner.get_added_tokens_decoder() {
            if t.special {
                special.insert(id);
            }
        }

        let bos_token = token_text(config.get("bos_token"));
        let eos_token = token_text(config.get("eos_token"));
        let bos_id = bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or_else(|| json_ids(gen.get("bos_token_id")).first().copied());
        let mut eos_ids = Vec::new();
        for id in eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .chain(json_ids(gen.get("eos_token_id")))
        {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let bos_token = bos_token.or_else(|| bos_id.and_then(|i| inner.id_to_token(i)));
        let eos_token = eos_token.or_else(|| eos_ids.first().and_then(|&i| inner.id_to_token(i)));

        let add_bos = match config.get("add_bos_token").and_then(Json::as_bool) {
            Some(b) => b,
            None => match bos_id {
                Some(bos) => {
                    let with = inner.encode("a", true).map_err(tk_err)?;
                    let without = inner.encode("a", false).map_err(tk_err)?;
                    with.get_ids().first() == Some(&bos) && without.get_ids().first() != Some(&bos)
                }
                None => false,
            },
        };

        let mut template = template_text(config.get("chat_template"));
        if template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            match std::fs::read_to_string(&jinja) {
                Ok(s) => template = Some(s),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("{}: cannot read", jinja.display()))
                }
            }
        }
        if template.is_none() {
            if let Some(j) = read_json(&dir.join("chat_template.json"))? {
                template = template_text(j.get("chat_template"));
            }
        }
        let chat_template = match template {
            Some(src) => Some(
                ChatTemplate::new(&src, bos_token.as_deref(), eos_token.as_deref())
                    .context("chat_template")?,
            ),
            None => None,
        };

        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer {
            inner,
            vocab_size,
            bos_id,
            eos_ids,
            bos_token,
            eos_token,
            add_bos,
            special,
            chat_template,
            text_only: OnceLock::new(),
            special_texts: OnceLock::new(),
            max_token_bytes: OnceLock::new(),
        })
    }

    /// Encodes `text`. Special-token text in it (`<|im_start|>`) is encoded
    /// as the special token. With `add_special`, BOS is prepended if the
    /// model's configuration asks for it and the text does not already start
    /// with it.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenize the text: {e}"))?;
        let ids = enc.get_ids();
        match self.bos_id {
            Some(bos) if add_special && self.add_bos && ids.first() != Some(&bos) => {
                let mut out = Vec::with_capacity(ids.len() + 1);
                out.push(bos);
                out.extend_from_slice(ids);
                Ok(out)
            }
            _ => Ok(ids.to_vec()),
        }
    }

    /// Encodes an input of a pooling model as transformers' tokenizer does
    /// with `add_special_tokens=True`: the tokenizer's post-processor adds
    /// its special tokens (BERT's `[CLS]`/`[SEP]`, the `<|endoftext|>`
    /// Qwen3-Embedding pools), which is what the model was trained to see.
    pub fn encode_for_pooling(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| anyhow!("cannot tokenize the text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes a pair for a cross-encoder as transformers does with
    /// `add_special_tokens=True` (BERT: `[CLS] first [SEP] second [SEP]`),
    /// each token's type (0 for the first text and its specials, 1 for the
    /// second) packed into its high bits
    /// ([`pagoda_accel::ops::TOKEN_TYPE_SHIFT`]), as the encoder reads it.
    pub fn encode_pair_for_scoring(&self, first: &str, second: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode((first, second), true)
            .map_err(|e| anyhow!("cannot tokenize the pair: {e}"))?;
        Ok(pack_token_types(enc.get_ids(), enc.get_type_ids()))
    }

    /// [`Tokenizer::encode_pair_for_scoring`] cut to at most `max_len`
    /// tokens, special tokens included, as transformers' `truncation=True`
    /// cuts a pair (longest first, from the right): vLLM's
    /// `truncate_prompt_tokens` on the score endpoints.
    pub fn encode_pair_truncated(
        &self,
        first: &str,
        second: &str,
        max_len: usize,
    ) -> Result<Vec<u32>> {
        let mut t = self.inner.clone();
        t.with_truncation(Some(tokenizers::TruncationParams {
            max_length: max_len,
            ..Default::default()
        }))
        .map_err(|e| anyhow!("cannot truncate to {max_len} tokens: {e}"))?;
        let enc = t
            .encode((first, second), true)
            .map_err(|e| anyhow!("cannot tokenize the pair: {e}"))?;
        Ok(pack_token_types(enc.get_ids(), enc.get_type_ids()))
    }

    /// The token sequences `bad_words` ban, as vLLM tokenizes them
    /// (`SamplingParams.update_from_tokenizer`): each word, stripped of
    /// leading whitespace, as it encodes at the start of a text; and, with
    /// a leading space, as it encodes in the middle of one, when that is a
    /// different first token in as many tokens.
    ///
    /// # Errors
    /// If a word encodes to no token (it is empty or whitespace), or
    /// cannot be tokenized.
    pub fn bad_words_ids(&self, bad_words: &[String]) -> Result<Vec<Vec<u32>>> {
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(2 * bad_words.len());
        for word in bad_words {
            let word = word.trim_start();
            let alone = self.encode(word, false)?;
            let Some(&first) = alone.first() else {
                return Err(anyhow!("bad word {word:?} encodes to no token"));
            };
            let spaced = self.encode(&format!(" {word}"), false)?;
            // A leading space that only adds a space token, or splits the
            // word differently, would ban something else than the word.
            let keep = spaced.first().is_some_and(|&t| t != first) && spaced.len() == alone.len();
            out.push(alone);
            if keep {
                out.push(spaced);
            }
        }
        Ok(out)
    }

    /// Whether a text of `text_bytes` bytes must encode to more than
    /// `tokens` tokens, judged from its length alone, so that an over-long
    /// prompt is refused before it is tokenized whole. Conservative: no
    /// token spells more than the longest token's text, and normalization
    /// (NFC composes at most about 3 bytes into 1) is allowed for 4 times
    /// over, so a prompt that fits is never refused.
    pub fn surely_longer_than(&self, text_bytes: usize, tokens: usize) -> bool {
        const SLACK: usize = 4096;
        // Cheap first: any limit below is at least this.
        if text_bytes <= tokens.saturating_mul(16).saturating_add(SLACK) {
            return false;
        }
        let per_token = *self.max_token_bytes.get_or_init(|| {
            (0..self.vocab_size as u32)
                .filter_map(|id| self.inner.decode(&[id], false).ok())
                .map(|t| t.len())
                .max()
                .unwrap_or(1)
        });
        text_bytes
            > tokens
                .saturating_mul(per_token.max(4) * 4)
                .saturating_add(SLACK)
    }

    /// Encodes `text` as plain text: special-token text in it
    /// (`<|im_end|>`) becomes the ordinary tokens that spell it, never the
    /// control token. For text a client wrote.
    pub fn encode_as_text(&self, text: &str) -> Result<Vec<u32>> {
        let t = self.text_only.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = t
            .encode(text, false)
            .map_err(|e| anyhow!("cannot tokenize the text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes a rendered chat prompt, in which the template's own markers
    /// are the only control tokens: wherever one of `client_texts` (the
    /// messages' contents, in order) holds special-token text, that text is
    /// encoded as plain text, so a message cannot close its turn or open a
    /// system turn by writing `<|im_end|>`. Prompts whose client texts hold
    /// no special-token text are encoded exactly as [`Tokenizer::encode`]
    /// (without BOS: the template places it) would.
    ///
    /// # Errors
    /// If a client text that holds special-token text does not appear in
    /// the rendered prompt (a template that rewrote it), since it could not
    /// then be kept apart.
    pub fn encode_chat(&self, rendered: &str, client_texts: &[&str]) -> Result<Vec<u32>> {
        let specials = self.special_texts();
        let holds_special = |t: &str| specials.iter().any(|s| t.contains(s.as_str()));
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let mut from = 0;
        for text in client_texts.iter().copied().filter(|t| holds_special(t)) {
            let find = |needle: &str| {
                rendered[from..]
                    .find(needle)
                    .map(|i| (from + i, from + i + needle.len()))
            };
            let Some((a, b)) = find(text).or_else(|| find(text.trim())) else {
                bail!(
                    "a message's content holds special-token text, and the chat template changed that content, so it cannot be kept as plain text; remove the special-token text from the message"
                );
            };
            ranges.push((a, b));
            from = b;
        }
        if ranges.is_empty() {
            return self.encode(rendered, false);
        }
        let mut ids = Vec::new();
        let mut pos = 0;
        for (a, b) in ranges {
            if a > pos {
                ids.extend(self.encode(&rendered[pos..a], false)?);
            }
            ids.extend(self.encode_as_text(&rendered[a..b])?);
            pos = b;
        }
        if pos < rendered.len() {
            ids.extend(self.encode(&rendered[pos..], false)?);
        }
        Ok(ids)
    }

    /// Replaces the model's chat template with `source` (`--chat-template`).
    pub fn set_chat_template(&mut self, source: &str) -> Result<()> {
        self.chat_template = Some(ChatTemplate::new(
            source,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )?);
        Ok(())
    }

    /// The texts of the special tokens (`<|im_end|>`, ...).
    pub fn special_texts(&self) -> &[String] {
        self.special_texts.get_or_init(|| {
            self.special
                .iter()
                .filter_map(|&id| self.inner.id_to_token(id))
                .filter(|t| !t.is_empty())
                .collect()
        })
    }

    /// Decodes `ids` into text; with `skip_special`, special tokens are left
    /// out. Byte sequences that are not valid UTF-8 become U+FFFD. An id
    /// outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                self.vocab_size
            );
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("cannot decode token ids: {e}"))
    }

    /// The number of token ids (the model's vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The beginning-of-sequence token id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether [`encode`](Self::encode) prepends BOS when asked for special tokens.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Every id that ends a sequence: EOS, plus end-of-turn/end-of-message
    /// ids the metadata lists and all of `generation_config.json`'s.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS token's text.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The (first) EOS token's text.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The raw text of token `id` as stored in the vocabulary (byte-level
    /// tokens keep their `Ġ`-style characters, SentencePiece ones their `▁`).
    pub fn token_to_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of the token whose raw text is exactly `token`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` is a special token (GGUF control or unknown token, or an
    /// HF added token marked special), which `decode(…, skip_special = true)`
    /// leaves out.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The bytes each token id stands for, as constrained decoding needs
    /// them: byte-level BPE characters (`Ġ`) mapped back to their bytes,
    /// SentencePiece's `▁` to a space and `<0xNN>` to that byte, added
    /// tokens as their text. Special tokens are prefixed with 0xFF (never a
    /// byte of UTF-8 text, which is how llguidance's token trie tells them
    /// apart), so no grammar over text can produce them. Index = token id;
    /// ids the vocabulary lacks get no bytes.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let decoder = self
            .inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .unwrap_or(Json::Null);
        let kinds = |d: &Json| -> Vec<String> {
            match d.get("type").and_then(Json::as_str) {
                Some("Sequence") => d
                    .get("decoders")
                    .and_then(Json::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.get("type").and_then(Json::as_str))
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default(),
                Some(t) => vec![t.to_owned()],
                None => Vec::new(),
            }
        };
        let kinds = kinds(&decoder);
        let byte_level = kinds.iter().any(|k| k == "ByteLevel");
        let byte_fallback = kinds.iter().any(|k| k == "ByteFallback");
        let unicode_to_byte = byte_level_inverse();
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    let mut b = Vec::with_capacity(t.content.len() + 1);
                    if t.special || self.special.contains(&id) {
                        b.push(0xFF);
                    }
                    b.extend_from_slice(t.content.as_bytes());
                    return b;
                }
                let Some(raw) = self.inner.id_to_token(id) else {
                    return Vec::new();
                };
                if self.special.contains(&id) {
                    let mut b = vec![0xFF];
                    b.extend_from_slice(raw.as_bytes());
                    return b;
                }
                if byte_level {
                    let mut b = Vec::with_capacity(raw.len());
                    for c in raw.chars() {
                        match unicode_to_byte.get(&c) {
                            Some(&x) => b.push(x),
                            // Not a byte-level character (a hand-added
                            // token): its own UTF-8.
                            None => b.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    return b;
                }
                if byte_fallback {
                    if let Some(x) = raw
                        .strip_prefix("<0x")
                        .and_then(|r| r.strip_suffix('>'))
                        .filter(|h| h.len() == 2)
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        return vec![x];
                    }
                }
                raw.replace('▁', " ").into_bytes()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn regexes_compile() {
        for (name, re) in pre_tokenizer_regexes() {
            Split::new(
                SplitPattern::Regex(re.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn merges_from_scores_prefers_high_scores() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -0.5];
        let types = [1; 6];
        let m = merges_from_scores(&tokens, &scores, &types);
        let pairs: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(
            pairs,
            vec![("a", "bc"), ("ab", "c"), ("b", "c"), ("a", "b")]
        );
    }

    #[test]
    fn template_and_token_text_forms() {
        let j: Json = serde_json::json!({
            "a": "<s>",
            "b": {"content": "</s>", "lstrip": false},
            "t": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            "u": [{"name": "x", "template": "X"}]
        });
        assert_eq!(token_text(j.get("a")).as_deref(), Some("<s>"));
        assert_eq!(token_text(j.get("b")).as_deref(), Some("</s>"));
        assert_eq!(template_text(j.get("t")).as_deref(), Some("D"));
        assert_eq!(template_text(j.get("u")).as_deref(), Some("X"));
        assert_eq!(template_text(j.get("a")).as_deref(), Some("<s>"));
        assert_eq!(json_ids(Some(&serde_json::json!([1, 2]))), vec![1, 2]);
        assert_eq!(json_ids(Some(&serde_json::json!(7))), vec![7]);
    }
}

/// Packs each token's type into its id's high bits (see
/// [`pagoda_accel::ops::TOKEN_TYPE_SHIFT`]).
pub fn pack_token_types(ids: &[u32], types: &[u32]) -> Vec<u32> {
    ids.iter()
        .zip(types.iter().chain(std::iter::repeat(&0)))
        .map(|(&id, &ty)| id | (ty << pagoda_accel::ops::TOKEN_TYPE_SHIFT))
        .collect()
}
