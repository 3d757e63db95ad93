use std::collections::HashMap;
use std::fmt;
use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Learned output sizes: per route, a sliding window of the output tokens real responses used,
/// and a high quantile of it (the p95 by default) as the output to reserve.
///
/// Reserving `max_tokens` for every call is safe but idle: a classifier that answers ten
/// tokens with `max_tokens: 4096` holds 400 times what it uses until its response settles.
/// Reserving what the route's recent answers needed lets more calls in at once, while the
/// reconcile step still debits an answer that runs over.
///
/// A route is any key the caller chooses (the [`EstimateLayer`](super::EstimateLayer) uses the
/// path and the model by default). Memory is bounded: [`LearnedOutput::with_window`] samples
/// per route (256 by default), [`LearnedOutput::with_max_routes`] routes (1,024 by default),
/// the least recently used route evicted first. One mutex guards the map; each call holds it
/// for a hash lookup, plus a selection over at most one window when the quantile changed.
/// Everything is deterministic: the same records give the same estimates.
///
/// Cloning is cheap and shares the samples.
///
/// # Example
///
/// ```
/// use std::num::NonZeroUsize;
/// use tower_llm_quota::estimate::LearnedOutput;
///
/// let learned = LearnedOutput::new().with_min_samples(NonZeroUsize::new(10).unwrap());
/// for tokens in 1..=100 {
///     learned.record("/v1/chat/completions gpt-4o", tokens);
/// }
/// assert_eq!(learned.estimate("/v1/chat/completions gpt-4o"), Some(95));
/// assert_eq!(learned.estimate("unknown"), None);
/// ```
#[derive(Clone)]
pub struct LearnedOutput {
    state: Arc<Inner>,
}

struct Inner {
    config: Config,
    state: Mutex<State>,
}

#[derive(Debug, Clone, Copy)]
struct Config {
    window: usize,
    max_routes: usize,
    quantile: f64,
    min_samples: usize,
}

struct State {
    routes: HashMap<Box<str>, Route>,
    /// A logical clock: each use of a route stamps it, the smallest stamp is evicted.
    clock: u64,
}

struct Route {
    /// The last `window` outputs, oldest overwritten first.
    samples: Vec<u64>,
    /// Where the next sample goes once the window is full.
    next: usize,
    /// The quantile of `samples`, until the next record.
    cached: Option<u64>,
    last_used: u64,
}

impl LearnedOutput {
    /// Samples kept per route by default.
    pub const DEFAULT_WINDOW: usize = 256;
    /// Routes kept by default.
    pub const DEFAULT_MAX_ROUTES: usize = 1_024;
    /// The quantile estimated by default: the p95.
    pub const DEFAULT_QUANTILE: f64 = 0.95;
    /// Samples a route needs before it is trusted, by default.
    pub const DEFAULT_MIN_SAMPLES: usize = 20;

    /// An empty store with the defaults.
    pub fn new() -> Self {
        Self::with_config(Config {
            window: Self::DEFAULT_WINDOW,
            max_routes: Self::DEFAULT_MAX_ROUTES,
            quantile: Self::DEFAULT_QUANTILE,
            min_samples: Self::DEFAULT_MIN_SAMPLES,
        })
    }

    fn with_config(config: Config) -> Self {
        Self {
            state: Arc::new(Inner {
                config,
                state: Mutex::new(State {
                    routes: HashMap::new(),
                    clock: 0,
                }),
            }),
        }
    }

    /// A new, empty store keeping the last `window` samples of each route.
    pub fn with_window(self, window: NonZeroUsize) -> Self {
        let config = self.state.config;
        Self::with_config(Config {
            window: window.get(),
            ..config
        })
    }

    /// A new, empty store keeping at most `max_routes` routes.
    pub fn with_max_routes(self, max_routes: NonZeroUsize) -> Self {
        let config = self.state.config;
        Self::with_config(Config {
            max_routes: max_routes.get(),
            ..config
        })
    }

    /// A new, empty store estimating the `quantile` (in `[0, 1]`) of each window. The
    /// nearest-rank definition is used: the smallest sample at least `quantile` of the window
    /// does not exceed. Fails when `quantile` is outside `[0, 1]` (or NaN).
    pub fn with_quantile(self, quantile: f64) -> Result<Self, InvalidQuantile> {
        if !(0.0..=1.0).contains(&quantile) {
            return Err(InvalidQuantile("the quantile must be in [0, 1]"));
        }
        let config = self.state.config;
        Ok(Self::with_config(Config { quantile, ..config }))
    }

    /// A new, empty store that estimates a route only once it holds `min_samples` samples.
    /// A route never holds more than the window: a larger `min_samples` waits for a full
    /// window.
    pub fn with_min_samples(self, min_samples: NonZeroUsize) -> Self {
        let config = self.state.config;
        Self::with_config(Config {
            min_samples: min_samples.get(),
            ..config
        })
    }

    /// Records that a response of `route` used `output_tokens` output tokens. A new route
    /// evicts the least recently used one when the store is full.
    pub fn record(&self, route: &str, output_tokens: u64) {
        let config = &self.state.config;
        let mut state = self.lock();
        state.clock += 1;
        let now = state.clock;
        if !state.routes.contains_key(route) && state.routes.len() >= config.max_routes {
            let oldest = state
                .routes
                .iter()
                .min_by_key(|(_, r)| r.last_used)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                state.routes.remove(&oldest);
            }
        }
        let entry = state.routes.entry(route.into()).or_insert_with(|| Route {
            samples: Vec::new(),
            next: 0,
            cached: None,
            last_used: now,
        });
        entry.last_used = now;
        entry.cached = None;
        if entry.samples.len() < config.window {
            entry.samples.push(output_tokens);
        } else {
            entry.samples[entry.next] = output_tokens;
            entry.next = (entry.next + 1) % config.window;
        }
    }

    /// The output tokens to expect from `route`: the quantile of its recent samples, or `None`
    /// while it has fewer than the minimum samples (20 by default). Counts as a use of the
    /// route for eviction.
    pub fn estimate(&self, route: &str) -> Option<u64> {
        let config = &self.state.config;
        let mut state = self.lock();
        state.clock += 1;
        let now = state.clock;
        let entry = state.routes.get_mut(route)?;
        entry.last_used = now;
        if entry.samples.len() < config.min_samples.min(config.window) {
            return None;
        }
        if entry.cached.is_none() {
            entry.cached = Some(quantile(&entry.samples, config.quantile));
        }
        entry.cached
    }

    /// Samples held for `route`.
    pub fn samples(&self, route: &str) -> usize {
        self.lock().routes.get(route).map_or(0, |r| r.samples.len())
    }

    /// Routes held.
    pub fn routes(&self) -> usize {
        self.lock().routes.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state inconsistent enough to matter:
        // at worst one sample is missing.
        self.state
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The nearest-rank quantile of a non-empty slice.
fn quantile(samples: &[u64], q: f64) -> u64 {
    let n = samples.len();
    // ceil(q × n), between 1 and n: the rank of the answer.
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    let mut sorted = samples.to_vec();
    let (_, value, _) = sorted.select_nth_unstable(rank - 1);
    *value
}

impl Default for LearnedOutput {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LearnedOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = &self.state.config;
        f.debug_struct("LearnedOutput")
            .field("window", &config.window)
            .field("max_routes", &config.max_routes)
            .field("quantile", &config.quantile)
            .field("min_samples", &config.min_samples)
            .field("routes", &self.routes())
            .finish()
    }
}

/// The route a request's output is learned under, put in the request's extensions by an
/// [`EstimateLayer`](super::EstimateLayer) that learns outputs, so that whatever reads the real
/// usage can feed it back with [`OutputRoute::record`].
///
/// # Example
///
/// ```
/// use std::num::NonZeroU64;
/// use tower_llm_quota::estimate::{LearnedOutput, OutputRoute};
///
/// let learned = LearnedOutput::new();
/// let two = NonZeroU64::new(2).unwrap();
/// let route = OutputRoute::new(learned.clone(), "/v1/chat/completions gpt-4o", two);
/// // Two choices used 300 output tokens: 150 each are learned.
/// route.record(300);
/// assert_eq!(learned.samples("/v1/chat/completions gpt-4o"), 1);
/// ```
#[derive(Clone)]
pub struct OutputRoute {
    learned: LearnedOutput,
    route: Arc<str>,
    choices: u64,
}

impl OutputRoute {
    /// The route `route` of `learned`, for a request asking for `choices` choices.
    pub fn new(learned: LearnedOutput, route: impl Into<Arc<str>>, choices: NonZeroU64) -> Self {
        Self {
            learned,
            route: route.into(),
            choices: choices.get(),
        }
    }

    /// The route's key.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// The store it feeds.
    pub fn learned(&self) -> &LearnedOutput {
        &self.learned
    }

    /// Choices the request asked for.
    pub fn choices(&self) -> u64 {
        self.choices
    }

    /// Records the response's real output tokens (all choices together, as usage reports
    /// them), learned per choice.
    pub fn record(&self, output_tokens: u64) {
        self.learned
            .record(&self.route, output_tokens.div_ceil(self.choices));
    }
}

impl fmt::Debug for OutputRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutputRoute")
            .field("route", &self.route)
            .field("choices", &self.choices)
            .finish_non_exhaustive()
    }
}
/// A quantile outside `[0, 1]`, refused by [`LearnedOutput::with_quantile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidQuantile(&'static str);

impl fmt::Display for InvalidQuantile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for InvalidQuantile {}
