//! A simulated LLM provider that enforces quota like the real ones (feature `sim`).
