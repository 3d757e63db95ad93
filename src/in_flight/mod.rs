//! Cap the calls in flight, holding each slot until the response body ends.
//!
//! Tower's `ConcurrencyLimit` releases its permit when the response future completes, that is
//! when the response *head* arrives; an LLM stream goes on for seconds or minutes after that, so
//! the provider sees more concurrent calls than the limit says. [`InFlightLimitLayer`] moves the
//! permit into the response body ([`InFlightBody`]) and releases it when the body ends, fails or
//! is dropped.
//!
//! Place it inside a [`TokenBudgetLayer`](crate::TokenBudgetLayer): the budget polls its inner
//! service's readiness only after admission, so the slot is taken right before the call, and a
//! request waiting for quota holds none.
//!
//! # Example
//!
//! ```
//! use http_body_util::{BodyExt, Full};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//! use tower_llm_quota::InFlightLimitLayer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_llm_quota::BoxError> {
//! let limit = InFlightLimitLayer::new(2);
//! let mut client = ServiceBuilder::new()
//!     .layer(limit.clone())
//!     .service(service_fn(|_req: http::Request<()>| async {
//!         Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(bytes::Bytes::from("tokens..."))))
//!     }));
//!
//! let response = client.ready().await?.call(http::Request::new(())).await?;
//! assert_eq!(limit.in_flight(), 1, "the head arrived; the stream still holds its slot");
//! response.into_body().collect().await?;
//! assert_eq!(limit.in_flight(), 0);
//! # Ok(()) }
//! ```

mod body;
mod future;
mod layer;
mod service;

pub use body::InFlightBody;
pub use future::ResponseFuture;
pub use layer::InFlightLimitLayer;
pub use service::InFlightLimit;
