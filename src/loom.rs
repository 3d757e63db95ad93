//! The synchronization the budget's ordering relies on: loom's when the unit tests are model
//! checked (built with `--cfg loom`), the standard library's otherwise, as tokio does.
//!
//! Only this crate is built with the flag (`cargo rustc --lib --profile test -- --cfg loom`,
//! see `.ci/run`): dependencies that know `cfg(loom)` would otherwise switch to loom too.

#[cfg(all(test, loom))]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(all(test, loom)))]
pub(crate) use std::sync::{Mutex, MutexGuard};
