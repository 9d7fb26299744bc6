//! Tracing's flags: where spans are exported, and as which service. The
//! standard OpenTelemetry variables set them as well.

use clap::Args;

use super::ConfigError;
use crate::telemetry::Settings;

/// The path of OTLP/HTTP's traces below a base endpoint.
const TRACES_PATH: &str = "/v1/traces";

/// What tracing (OpenTelemetry) is configured by; off without an endpoint.
#[derive(Debug, Clone, Args)]
pub struct TelemetryConfig {
    /// Export spans over OTLP/HTTP (protobuf) to this endpoint: a base URL
    /// such as `http://collector:4318`, to which `/v1/traces` is added
    /// (a URL already ending in `/v1/traces` is taken as it is). Spans: each
    /// submission (API), each attempt (worker), each outbound request of a
    /// handler; a `traceparent` header on a submission is their parent.
    /// Unset: no tracing, and no cost for it.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// The `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "dtq")]
    pub otel_service_name: String,
}

impl TelemetryConfig {
    /// The exporter's settings, or `None` when tracing is off; an endpoint
    /// that is not an http(s) URL is an error.
    pub fn settings(&self) -> Result<Option<Settings>, ConfigError> {
        let Some(endpoint) = self.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) else {
            return Ok(None);
        };
        let invalid = |reason: &str| ConfigError::Invalid {
            flag: "--otlp-endpoint",
            reason: format!("{endpoint:?}: {reason}"),
        };
        let url = reqwest::Url::parse(endpoint).map_err(|e| invalid(&e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(invalid("an http:// or https:// URL with a host is needed"));
        }
        let base = endpoint.trim_end_matches('/');
        let traces_url = match base.ends_with(TRACES_PATH) {
            true => base.to_owned(),
            false => format!("{base}{TRACES_PATH}"),
        };
        Ok(Some(Settings {
            traces_url,
            service_name: self.otel_service_name.clone(),
        }))
    }

    /// Check the endpoint.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.settings().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(endpoint: Option<&str>) -> TelemetryConfig {
        TelemetryConfig {
            otlp_endpoint: endpoint.map(str::to_owned),
            otel_service_name: "dtq".into(),
        }
    }

    #[test]
    fn the_traces_path_is_added_to_a_base_endpoint_once() {
        let url = |e| config(Some(e)).settings().unwrap().unwrap().traces_url;
        assert_eq!(url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(url("https://c/otlp"), "https://c/otlp/v1/traces");
        assert_eq!(url("http://c:4318/v1/traces"), "http://c:4318/v1/traces");
        assert_eq!(config(None).settings().unwrap(), None);
        assert_eq!(config(Some("")).settings().unwrap(), None);
    }

    #[test]
    fn an_endpoint_that_is_not_an_http_url_is_refused() {
        for bad in ["collector:4318", "ftp://c/", "not a url"] {
            let err = config(Some(bad)).settings().unwrap_err();
            assert!(
                err.to_string().starts_with("--otlp-endpoint: "),
                "{bad}: {err}"
            );
        }
    }
}
