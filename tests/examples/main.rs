//! The examples as users run them: the batch job (its pushback, its report, several processes
//! on one Redis quota, durable jobs surviving a killed worker), the Prometheus example, and the
//! README's tables against the code.

mod batch_job;
mod durable;
mod multi_process;
#[cfg(feature = "metrics")]
mod prometheus;
mod pushback;
mod readme_tables;

// The batch example's driver and workload, which the pushback tests run (the example uses
// more of them).
#[allow(dead_code)]
#[path = "../../examples/batch/run.rs"]
mod run;
#[allow(dead_code)]
#[path = "../../examples/batch/workload.rs"]
mod workload;
