//! Every routing decision is a tracing event.

use crate::routing_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use routing_support::*;
use tower_llm_quota::Priority;
use tower_llm_quota::routing::{Condition, Fallback, Router};
use tower_llm_quota_sim::{Faults, SimConfig};

/// Every routing decision is a tracing event: the route chosen, the fallback taken and why,
/// the compatibility check's refusals, the ramp's pauses.
#[tokio::test(start_paused = true)]
async fn routing_decisions_are_traced() {
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    #[derive(Clone, Default)]
    struct Events(Arc<Mutex<Vec<String>>>);

    struct Line<'a>(&'a mut String);

    impl tracing::field::Visit for Line<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }

        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            self.0.push_str(&format!(" {}={value}", field.name()));
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Events {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            if event
                .metadata()
                .target()
                .starts_with("tower_llm_quota::routing")
            {
                let mut line = String::new();
                event.record(&mut Line(&mut line));
                self.0.lock().unwrap().push(line);
            }
        }
    }

    let events = Events::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));
    let models = Models::default();
    let primary = simulator(
        SimConfig::openai(1_000, 1_000_000).faults(Faults::none().server_errors(1.0)),
        Duration::ZERO,
    );
    let fallback = simulator(SimConfig::openai(1_000, 1_000_000), Duration::ZERO);
    let router = Router::builder(route("a", &stack(100_000), sim_client(&primary), &models))
        .fallback(
            route("b", &stack(100_000), sim_client(&fallback), &models).attribute("tools", "no"),
            Fallback::when(Condition::provider_5xx()),
        )
        .compatible(|request, route| {
            !(request.has_field("tools") && route.attribute("tools") == Some("no"))
        })
        .build();
    send(&router, request(Priority::Interactive, 20, "")).await;
    send(
        &router,
        request(Priority::Interactive, 20, r#","tools":[{}]"#),
    )
    .await;
    let events = events.0.lock().unwrap().clone();
    let has = |needle: &str| events.iter().filter(|e| e.contains(needle)).count();
    assert_eq!(has("message=routed route=a"), 2, "{events:#?}");
    assert_eq!(
        has("message=routed to a fallback from=a to=b reason=provider_5xx"),
        1,
        "{events:#?}"
    );
    assert_eq!(
        has("message=fallback refused by the compatibility check from=a to=b reason=provider_5xx"),
        1,
        "{events:#?}"
    );
}
