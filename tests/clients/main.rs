//! The stack inside client crates: hyper and reqwest transports, `reqwest_middleware`, an
//! async-openai transport, rig's models, together against the simulated provider.

mod async_openai;
mod integrations;
mod middleware;
mod rig;
mod transports;
