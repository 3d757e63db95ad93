//! The recommended stack, assembled in one call for a provider profile.
