//! What providers send: the usage scanner against fixtures of each provider's formats, and
//! the provider profiles. (The wait-hint parsers are tested in the crate: `src/parse/tests.rs`.)

mod provider;
mod usage;
