//! The budget: admission, its ordering and fair share, tenants, saturation and stress, against
//! reference models and property tests; and the store seam from the outside (a store over a
//! mutex running the shared-store suite).

mod admission;
mod engine_model;
mod fair_share;
mod ordering;
mod props;
mod saturation;
mod store;
mod stress;
mod tenants;
