use serde_json::{Map, Value};

use super::{Estimator, LearnedOutput};
use crate::cost::Cost;
use crate::usage::ServiceTier;

/// What the body reader assumes where a request says nothing countable: the output reserved
/// without a `max_tokens`, the framing of each message, an image.
///
/// # Example
///
/// ```
/// use tower_llm_quota::estimate::Defaults;
///
/// let defaults = Defaults::new().with_output_tokens(1_024);
/// assert_eq!(defaults.output_tokens(), 1_024);
/// assert_eq!(defaults.message_tokens(), 4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Defaults {
    output_tokens: u64,
    message_tokens: u64,
    reply_tokens: u64,
    image_tokens: u64,
}

impl Defaults {
    /// Output tokens reserved for a request without a usable `max_tokens`,
    /// `max_completion_tokens` or `max_output_tokens`: 4,096.
    ///
    /// Without a bound the provider may generate up to the model's limit (16k to 128k tokens),
    /// which no budget should reserve for every call; 4,096 is above what most chat answers
    /// use, and the reconcile step refunds what is not spent. Set it to your model's limit
    /// when long answers without a `max_tokens` are common, or send a `max_tokens`.
    pub const DEFAULT_OUTPUT_TOKENS: u64 = 4_096;
    /// Tokens of framing per message: 4. OpenAI's token-counting guide counts 3 per message
    /// for current chat models (`<|start|>role ... <|end|>`) and 4 for the first GPT-3.5 Turbo;
    /// the higher figure errs high. A message's `name` is counted as text.
    pub const DEFAULT_MESSAGE_TOKENS: u64 = 4;
    /// Tokens priming the reply, once per request with messages: 3
    /// (`<|start|>assistant<|message|>` in OpenAI's guide).
    pub const DEFAULT_REPLY_TOKENS: u64 = 3;
    /// Tokens per image, audio clip or file part: 1,600, a flat amount since the body reader
    /// does not decode images.
    ///
    /// Anthropic charges about (width × height) / 750 tokens and resizes images beyond about
    /// 1.15 megapixels, so an image costs at most about 1,600 tokens; OpenAI's GPT-4o charges
    /// 85 to 1,105 for the largest high-detail image. Models that bill images with a
    /// multiplier (`gpt-4o-mini`, `gpt-4.1-mini`) count more: raise it for them.
    pub const DEFAULT_IMAGE_TOKENS: u64 = 1_600;

    /// The defaults above.
    pub const fn new() -> Self {
        Self {
            output_tokens: Self::DEFAULT_OUTPUT_TOKENS,
            message_tokens: Self::DEFAULT_MESSAGE_TOKENS,
            reply_tokens: Self::DEFAULT_REPLY_TOKENS,
            image_tokens: Self::DEFAULT_IMAGE_TOKENS,
        }
    }

    /// Output tokens reserved for a request that sets no usable maximum.
    pub const fn with_output_tokens(self, output_tokens: u64) -> Self {
        Self {
            output_tokens,
            ..self
        }
    }

    /// Tokens of framing per message.
    pub const fn with_message_tokens(self, message_tokens: u64) -> Self {
        Self {
            message_tokens,
            ..self
        }
    }

    /// Tokens priming the reply, once per request with messages.
    pub const fn with_reply_tokens(self, reply_tokens: u64) -> Self {
        Self {
            reply_tokens,
            ..self
        }
    }

    /// Tokens per image, audio clip or file part.
    pub const fn with_image_tokens(self, image_tokens: u64) -> Self {
        Self {
            image_tokens,
            ..self
        }
    }

    /// Output tokens reserved for a request that sets no usable maximum.
    pub const fn output_tokens(&self) -> u64 {
        self.output_tokens
    }

    /// Tokens of framing per message.
    pub const fn message_tokens(&self) -> u64 {
        self.message_tokens
    }

    /// Tokens priming the reply.
    pub const fn reply_tokens(&self) -> u64 {
        self.reply_tokens
    }

    /// Tokens per image, audio clip or file part.
    pub const fn image_tokens(&self) -> u64 {
        self.image_tokens
    }
}

impl Default for Defaults {
    fn default() -> Self {
        Self::new()
    }
}

/// What the body reader found in a request: its prompt tokens, the output bound it sets and
/// how many choices it asks for. [`RequestEstimate::cost`] turns it into a [`Cost`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEstimate {
    model: Option<String>,
    service_tier: Option<ServiceTier>,
    input_tokens: u64,
    max_output_tokens: Option<u64>,
    choices: u64,
    stream: Stream,
}

/// What a body asks of a streamed answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Stream {
    /// `"stream": true`.
    on: bool,
    /// It has a `stream_options` member.
    options: bool,
    /// `stream_options.include_usage` is true.
    usage: bool,
}

impl RequestEstimate {
    /// Whether the body asks for a streamed answer (`"stream": true`).
    pub fn streams(&self) -> bool {
        self.stream.on
    }

    /// Whether the body asks an OpenAI-style stream for its usage
    /// (`stream_options.include_usage`).
    pub fn asks_stream_usage(&self) -> bool {
        self.stream.usage
    }

    /// The same read, for the body rewritten to name `model` and `service_tier` (each when
    /// given): what a router that retargets a request hands on. The counts are kept: the
    /// estimator is assumed to count the text alike for both models.
    pub(crate) fn retarget(&mut self, model: Option<&str>, service_tier: Option<&str>) {
        if let Some(model) = model {
            self.model = Some(model.to_owned());
        }
        if let Some(tier) = service_tier {
            let tier = ServiceTier::parse(tier);
            self.service_tier = (tier != ServiceTier::Other).then_some(tier);
        }
    }

    /// Whether the body has a `stream_options` member.
    pub(super) fn has_stream_options(&self) -> bool {
        self.stream.options
    }

    /// The body's `model`, when it names one.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The body's `service_tier`, when it names one this crate knows (`auto` and unknown
    /// names are none: the provider chooses).
    pub fn service_tier(&self) -> Option<ServiceTier> {
        self.service_tier
    }

    /// Estimated prompt tokens, framing included.
    pub fn input_tokens(&self) -> u64 {
        self.input_tokens
    }

    /// The output bound the request sets (`max_completion_tokens`, `max_tokens` or
    /// `max_output_tokens`), per choice.
    pub fn max_output_tokens(&self) -> Option<u64> {
        self.max_output_tokens
    }

    /// The same request with the output bound `tokens` per choice, known some other way
    /// than from its body (the model's largest output, for a request that sets none): its
    /// cost reserves it.
    ///
    /// ```
    /// use tower_llm_quota::estimate::{CharEstimator, Defaults, read_request};
    ///
    /// let body = br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hi"}]}"#;
    /// let read = read_request(body, &CharEstimator::new(), &Defaults::new()).unwrap();
    /// assert_eq!(read.max_output_tokens(), None);
    /// let bounded = read.with_output_bound(16_384);
    /// assert_eq!(bounded.cost(&Defaults::new()).output_tokens(), 16_384);
    /// ```
    #[must_use]
    pub fn with_output_bound(self, tokens: u64) -> Self {
        Self {
            max_output_tokens: Some(tokens),
            ..self
        }
    }

    /// Choices asked for (`n`), at least 1.
    pub fn choices(&self) -> u64 {
        self.choices
    }

    /// Output tokens to reserve per choice: the request's bound, or the default.
    pub fn output_bound(&self, defaults: &Defaults) -> u64 {
        self.max_output_tokens.unwrap_or(defaults.output_tokens)
    }

    /// The cost: the prompt, plus the output bound (or the default reservation) times the
    /// choices; one request.
    pub fn cost(&self, defaults: &Defaults) -> Cost {
        Cost::new(
            self.input_tokens,
            self.output_bound(defaults).saturating_mul(self.choices),
        )
    }

    /// The cost, reserving per choice what `learned` expects for `route` (its quantile of
    /// recent outputs) when it has enough samples, bounded by the request's own maximum;
    /// otherwise as [`RequestEstimate::cost`].
    pub fn cost_learned(&self, defaults: &Defaults, learned: &LearnedOutput, route: &str) -> Cost {
        let per_choice = match learned.estimate(route) {
            Some(expected) => match self.max_output_tokens {
                Some(max) => expected.min(max),
                None => expected,
            },
            None => self.output_bound(defaults),
        };
        Cost::new(self.input_tokens, per_choice.saturating_mul(self.choices))
    }
}

/// The [`Cost`] of an LLM request body, or `None` when it is not a JSON request of a known
/// shape; shorthand for [`read_request`] then [`RequestEstimate::cost`].
///
/// # Example
///
/// ```
/// use tower_llm_quota::estimate::{self, CharEstimator, Defaults};
///
/// let body = br#"{"model":"gpt-4o","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;
/// let cost = estimate::estimate(body, &CharEstimator::new(), &Defaults::new()).unwrap();
/// // 4 of framing + "user" (4) + "hi" (3) + 3 priming the reply.
/// assert_eq!(cost.input_tokens(), 14);
/// assert_eq!(cost.output_tokens(), 100);
/// assert_eq!(estimate::estimate(b"not json", &CharEstimator::new(), &Defaults::new()), None);
/// ```
pub fn estimate(body: &[u8], estimator: &dyn Estimator, defaults: &Defaults) -> Option<Cost> {
    read_request(body, estimator, defaults).map(|request| request.cost(defaults))
}

/// Reads an LLM request body: its prompt tokens, output bound and choices. `None` when the body
/// is not a JSON object with `messages`, `input`, `contents` or `prompt`.
///
/// # What is counted
///
/// One reader serves OpenAI Chat Completions, OpenAI Responses, Anthropic Messages and Gemini's
/// `generateContent` (and the legacy Completions `prompt`), since their fields do not clash:
///
/// - **Messages** (`messages[]`, and the items of a Responses `input` array): each costs
///   [`Defaults::message_tokens`] of framing plus its text; the request adds
///   [`Defaults::reply_tokens`] once. A message's text is every string in it: `role`, `name`,
///   `content` as a string or as parts or blocks (`text`, `tool_result` content, `tool_use`
///   input, `tool_calls`, `function_call_output` output, reasoning summaries...), nested
///   objects counted as their JSON text. Skipped: `type`, `cache_control`, and opaque
///   payloads (`signature`, `encrypted_content`, `data`, `file_data`).
/// - **Images, audio and files** (`image_url`, `input_image`, `image`, `input_audio`, `file`,
///   `input_file`, and Anthropic `document` blocks whose source is not text): a flat
///   [`Defaults::image_tokens`] each.
/// - **System prompts**: Anthropic's `system` (a string or text blocks), the Responses
///   `instructions` and Gemini's `systemInstruction` count as one more message; a string
///   `input` too.
/// - **Gemini** (`contents[]` of `parts`): each content is a message; `inlineData` and
///   `fileData` parts are images; `generationConfig.maxOutputTokens` bounds the output and
///   `candidateCount` is its choices; `toolConfig` and a `responseSchema` count as JSON text.
/// - **Tools and schemas**: `tools`, `functions`, `tool_choice`, `response_format` and the
///   Responses `text` format count as their JSON text, which is more than the providers'
///   own rendering of them.
/// - **Output**: `max_completion_tokens`, `max_tokens` or `max_output_tokens` (the first
///   positive one), else [`Defaults::output_tokens`]; times `n` (Chat Completions' choices).
///
/// Each piece of text is counted with [`Estimator::count_for`] and the body's `model`.
pub fn read_request(
    body: &[u8],
    estimator: &dyn Estimator,
    defaults: &Defaults,
) -> Option<RequestEstimate> {
    let value: Value = serde_json::from_slice(body).ok()?;
    read_request_json(&value, estimator, defaults)
}

/// [`read_request`] over a body already parsed: a layer that parsed the body for its own
/// checks (the gateway does) reads it here without parsing it again, and may hand the result
/// to [`EstimateLayer`](super::EstimateLayer) as a request extension.
pub fn read_request_json(
    value: &Value,
    estimator: &dyn Estimator,
    defaults: &Defaults,
) -> Option<RequestEstimate> {
    let object = value.as_object()?;
    let model = object.get("model").and_then(Value::as_str);
    let reader = Reader {
        estimator,
        model,
        defaults,
    };
    let mut input = 0u64;
    let mut messages = 0u64;
    let mut known = false;
    let mut message = |tokens: u64| {
        messages += 1;
        defaults.message_tokens.saturating_add(tokens)
    };
    // Chat Completions and Anthropic Messages.
    if let Some(list) = object.get("messages").and_then(Value::as_array) {
        known = true;
        for item in list {
            input = input.saturating_add(message(reader.item(item)));
        }
    }
    // Responses.
    match object.get("input") {
        Some(Value::String(text)) => {
            known = true;
            input = input.saturating_add(message(reader.text(text)));
        }
        Some(Value::Array(items)) => {
            known = true;
            for item in items {
                input = input.saturating_add(message(reader.item(item)));
            }
        }
        _ => {}
    }
    // Gemini's `contents`.
    if let Some(list) = object.get("contents").and_then(Value::as_array) {
        known = true;
        for item in list {
            input = input.saturating_add(message(reader.item(item)));
        }
    }
    // Anthropic's system prompt, the Responses instructions, Gemini's system instruction.
    for key in [
        "system",
        "instructions",
        "systemInstruction",
        "system_instruction",
    ] {
        if let Some(system) = object.get(key).filter(|v| !v.is_null()) {
            input = input.saturating_add(message(reader.item(system)));
        }
    }
    if known && messages > 0 {
        input = input.saturating_add(defaults.reply_tokens);
    }
    // Legacy Completions.
    if let Some(prompt) = object
        .get("prompt")
        .filter(|p| p.is_string() || p.is_array())
    {
        known = true;
        input = input.saturating_add(reader.item(prompt));
    }
    if !known {
        return None;
    }
    // Tools and output schemas reach the model as text.
    for key in [
        "tools",
        "functions",
        "tool_choice",
        "response_format",
        "text",
        "toolConfig",
        "tool_config",
    ] {
        let tokens = match object.get(key) {
            Some(Value::String(text)) if key == "tool_choice" => reader.text(text),
            Some(value @ (Value::Array(_) | Value::Object(_))) => reader.json(value),
            _ => 0,
        };
        input = input.saturating_add(tokens);
    }
    // Gemini's bound, choices and output schema sit in its generation config.
    let generation = ["generationConfig", "generation_config"]
        .iter()
        .find_map(|key| object.get(*key).and_then(Value::as_object));
    let positive = |from: &Map<String, Value>, keys: &[&str]| {
        keys.iter()
            .find_map(|key| from.get(*key).and_then(Value::as_u64).filter(|&n| n > 0))
    };
    let mut max_output_tokens = positive(
        object,
        &["max_completion_tokens", "max_tokens", "max_output_tokens"],
    );
    let mut choices = positive(object, &["n"]);
    if let Some(config) = generation {
        max_output_tokens = max_output_tokens
            .or_else(|| positive(config, &["maxOutputTokens", "max_output_tokens"]));
        choices = choices.or_else(|| positive(config, &["candidateCount", "candidate_count"]));
        for key in ["responseSchema", "response_schema", "responseJsonSchema"] {
            if let Some(schema) = config.get(key).filter(|v| v.is_object()) {
                input = input.saturating_add(reader.json(schema));
            }
        }
    }
    let choices = choices.unwrap_or(1);
    Some(RequestEstimate {
        model: model.map(str::to_owned),
        service_tier: service_tier(object),
        input_tokens: input,
        max_output_tokens,
        choices,
        stream: stream(object),
    })
}

/// What the body asks of a streamed answer.
fn stream(object: &Map<String, Value>) -> Stream {
    let options = object.get("stream_options");
    Stream {
        on: object.get("stream").and_then(Value::as_bool) == Some(true),
        options: options.is_some(),
        usage: options
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true),
    }
}

/// The tier a body's `service_tier` asks for, if this crate knows it.
fn service_tier(object: &Map<String, Value>) -> Option<ServiceTier> {
    let tier = ServiceTier::parse(object.get("service_tier")?.as_str()?);
    (tier != ServiceTier::Other).then_some(tier)
}

/// Reads an embeddings request body (OpenAI `/v1/embeddings`): its `input` is a string, an
/// array of strings, an array of tokens or an array of token arrays; or Gemini's
/// `embedContent` (a `content` of text parts) and `batchEmbedContents` (`requests`, each with
/// a `content`); no output. `None` when the body is not a JSON object with such an input.
///
/// Strings are counted with [`Estimator::count_for`] and the body's `model`, token arrays
/// by their length; nothing is added for framing (embeddings models bill the input alone).
///
/// # Example
///
/// ```
/// use tower_llm_quota::estimate::{CharEstimator, Defaults, Estimator, read_embeddings};
///
/// let body = br#"{"model":"text-embedding-3-small","input":["a cat","sat",[1,2,3]]}"#;
/// let chars = CharEstimator::new();
/// let request = read_embeddings(body, &chars).unwrap();
/// assert_eq!(request.input_tokens(), chars.count("a cat") + chars.count("sat") + 3);
/// assert_eq!(request.cost(&Defaults::new()).output_tokens(), 0);
/// ```
pub fn read_embeddings(body: &[u8], estimator: &dyn Estimator) -> Option<RequestEstimate> {
    let value: Value = serde_json::from_slice(body).ok()?;
    read_embeddings_json(&value, estimator)
}

/// [`read_embeddings`] over a body already parsed (see [`read_request_json`]).
pub fn read_embeddings_json(value: &Value, estimator: &dyn Estimator) -> Option<RequestEstimate> {
    let object = value.as_object()?;
    let model = object.get("model").and_then(Value::as_str);
    let count = |text: &str| match model {
        Some(model) => estimator.count_for(model, text),
        None => estimator.count(text),
    };
    // Gemini: `embedContent`'s `content`, `batchEmbedContents`' `requests`.
    let content = |value: &Value| {
        let parts = value.get("parts")?.as_array()?;
        Some(parts.iter().fold(0u64, |sum, part| {
            let tokens = part.get("text").and_then(Value::as_str).map_or(0, count);
            sum.saturating_add(tokens)
        }))
    };
    let gemini = match (object.get("content"), object.get("requests")) {
        (Some(one), _) => Some(content(one)?),
        (None, Some(Value::Array(requests))) => {
            Some(requests.iter().try_fold(0u64, |sum, r| {
                Some(sum.saturating_add(content(r.get("content")?)?))
            })?)
        }
        _ => None,
    };
    let input_tokens = match gemini {
        Some(tokens) => tokens,
        None => match object.get("input")? {
            Value::String(text) => count(text),
            Value::Array(items) if items.iter().all(Value::is_number) => items.len() as u64,
            Value::Array(items) => items.iter().try_fold(0u64, |sum, item| {
                let tokens = match item {
                    Value::String(text) => count(text),
                    Value::Array(tokens) => tokens.len() as u64,
                    _ => return None,
                };
                Some(sum.saturating_add(tokens))
            })?,
            _ => return None,
        },
    };
    Some(RequestEstimate {
        model: model.map(str::to_owned),
        service_tier: service_tier(object),
        input_tokens,
        max_output_tokens: Some(0),
        choices: 1,
        stream: Stream::default(),
    })
}

/// Keys whose values are not sent to the model as text.
const SKIPPED: [&str; 6] = [
    "type",
    "cache_control",
    "signature",
    "encrypted_content",
    "data",
    "file_data",
];

/// Keys holding content: a string, parts or blocks, walked rather than counted as JSON.
const CONTENT: [&str; 4] = ["content", "output", "summary", "parts"];

struct Reader<'a> {
    estimator: &'a dyn Estimator,
    model: Option<&'a str>,
    defaults: &'a Defaults,
}

impl Reader<'_> {
    fn text(&self, text: &str) -> u64 {
        match self.model {
            Some(model) => self.estimator.count_for(model, text),
            None => self.estimator.count(text),
        }
    }

    fn json(&self, value: &Value) -> u64 {
        self.text(&value.to_string())
    }

    /// A message, an input item, content or a part.
    fn item(&self, value: &Value) -> u64 {
        match value {
            Value::Null => 0,
            Value::String(text) => self.text(text),
            Value::Array(items) => items
                .iter()
                .fold(0u64, |sum, item| sum.saturating_add(self.item(item))),
            Value::Object(map) => self.object(map),
            Value::Bool(_) | Value::Number(_) => self.json(value),
        }
    }

    fn object(&self, map: &Map<String, Value>) -> u64 {
        let kind = map.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "image_url" | "input_image" | "image" | "input_audio" | "audio" | "file"
            | "input_file" => return self.defaults.image_tokens,
            "document" => return self.document(map),
            // Gemini's parts: inline bytes or a file, whatever their medium.
            _ if ["image_url", "inlineData", "inline_data", "fileData"]
                .iter()
                .any(|key| map.contains_key(*key)) =>
            {
                return self.defaults.image_tokens;
            }
            _ => {}
        }
        map.iter()
            .filter(|(key, _)| !SKIPPED.contains(&key.as_str()))
            .fold(0u64, |sum, (key, value)| {
                let tokens = match value {
                    Value::Null | Value::Bool(_) => 0,
                    Value::String(text) => self.text(text),
                    _ if CONTENT.contains(&key.as_str()) => self.item(value),
                    _ => self.json(value),
                };
                sum.saturating_add(tokens)
            })
    }

    /// An Anthropic document block: its text when the source is text, a flat amount when it
    /// is a PDF or an image.
    fn document(&self, map: &Map<String, Value>) -> u64 {
        let source = map.get("source").and_then(Value::as_object);
        let body = match source.and_then(|s| s.get("type")).and_then(Value::as_str) {
            Some("text") => source
                .and_then(|s| s.get("data"))
                .and_then(Value::as_str)
                .map_or(0, |text| self.text(text)),
            Some("content") => source
                .and_then(|s| s.get("content"))
                .map_or(0, |content| self.item(content)),
            _ => self.defaults.image_tokens,
        };
        let extra = ["title", "context"]
            .iter()
            .filter_map(|key| map.get(*key).and_then(Value::as_str))
            .fold(0u64, |sum, text| sum.saturating_add(self.text(text)));
        body.saturating_add(extra)
    }
}
