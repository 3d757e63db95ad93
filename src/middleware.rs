//! Run a `reqwest_middleware` client's requests through a tower stack (feature `reqwest`).
