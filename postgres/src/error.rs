//! The crate's error: an invalid address, a database out of reach, a schema it cannot use,
//! or a migration refused.

use std::fmt;
use std::sync::Arc;

/// An error of the Postgres store: an invalid address, a database out of reach, a schema it
/// cannot use, or a migration the database refused. Its message names the database's
/// address, the password hidden.
#[derive(Debug)]
pub struct Error {
    kind: Kind,
    address: Arc<str>,
    message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Config,
    Unreachable,
    Schema,
    Migration,
}

impl Error {
    pub(crate) fn config(address: &str, message: impl fmt::Display) -> Self {
        Self::new(Kind::Config, address, message)
    }

    pub(crate) fn unreachable(address: &str, message: impl fmt::Display) -> Self {
        Self::new(Kind::Unreachable, address, message)
    }

    pub(crate) fn schema(address: &str, message: impl fmt::Display) -> Self {
        Self::new(Kind::Schema, address, message)
    }

    pub(crate) fn migration(address: &str, message: impl fmt::Display) -> Self {
        Self::new(Kind::Migration, address, message)
    }

    fn new(kind: Kind, address: &str, message: impl fmt::Display) -> Self {
        Self {
            kind,
            address: address.into(),
            message: message.to_string(),
        }
    }

    /// The address was not valid.
    pub fn is_config(&self) -> bool {
        self.kind == Kind::Config
    }

    /// The database did not answer (refused, timed out, or the connection failed).
    pub fn is_unreachable(&self) -> bool {
        self.kind == Kind::Unreachable
    }

    /// The database's schema is not the crate's: older (migrate first) or newer.
    pub fn is_schema(&self) -> bool {
        self.kind == Kind::Schema
    }

    /// A migration was refused by the database (read-only, full, no permission): rolled back.
    pub fn is_migration(&self) -> bool {
        self.kind == Kind::Migration
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            Kind::Config => "invalid Postgres address",
            Kind::Unreachable => "Postgres is out of reach",
            Kind::Schema => "the Postgres schema cannot be used",
            Kind::Migration => "the Postgres schema could not be migrated",
        };
        write!(f, "{what} ({}): {}", self.address, self.message)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_address_without_its_password() {
        let error = Error::unreachable("postgres://app:***@db/quota", "connection refused");
        let text = error.to_string();
        assert!(text.contains("postgres://app:***@db/quota"), "{text}");
        assert!(error.is_unreachable() && !error.is_schema());
    }
}
