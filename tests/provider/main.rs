//! What providers send: header and body parsing, the usage scanner against fixtures of each
//! provider's formats, and the provider profiles.

mod parse;
mod provider;
mod usage;
