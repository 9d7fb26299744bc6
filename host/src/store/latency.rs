//! The store's own metric: how long its round trips to Redis take, by
//! operation (`dtq_redis_round_trip_seconds`). The store records it; the
//! process's metrics registry (`crate::metrics`) only exposes it, so the
//! store imports nothing of the metrics.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Buckets of Redis round trips (s): 100 µs to 5 s.
const REDIS_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
}

fn redis_histogram() -> Histogram {
    Histogram::new(REDIS_BUCKETS)
}

/// The latency of the store's round trips to Redis, by operation. The
/// store owns it (every clone of a store shares it); the process's metrics
/// registry exposes it ([`RedisLatency::register`]).
#[derive(Debug, Clone)]
pub struct RedisLatency(Family<OperationLabels, Histogram, fn() -> Histogram>);

impl Default for RedisLatency {
    fn default() -> Self {
        RedisLatency(Family::new_with_constructor(redis_histogram))
    }
}

impl RedisLatency {
    /// Record one round trip of `operation` that took `elapsed`.
    pub fn observe(&self, operation: &'static str, elapsed: Duration) {
        self.0
            .get_or_create(&OperationLabels { operation })
            .observe(elapsed.as_secs_f64());
    }

    /// Register the histograms in `registry`, as
    /// `dtq_redis_round_trip_seconds`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "dtq_redis_round_trip",
            "Round trips to Redis made by the store, by operation",
            Unit::Seconds,
            self.0.clone(),
        );
    }
}
