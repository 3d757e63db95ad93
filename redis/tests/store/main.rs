//! The Redis store against private `redis-server` instances (and a private Redis Cluster): the
//! budget over Redis, its scripts alone, leased shares and their churn, a tenant's controls and
//! limits over processes, and the shared-store suite.

mod budget;
mod cluster;
mod fleet_controls;
mod lease_churn;
mod leases;
mod scripts;
mod suite;
mod tenants;
