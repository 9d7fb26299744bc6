//! The web dashboard: `GET /ui/` and its assets, embedded in the binary.
//!
//! The dashboard is a few static files (`host/ui/`: HTML, CSS and
//! JavaScript modules, no build step) that talk to the JSON API like any
//! other client. So these routes need no token and read nothing: every
//! datum the page shows comes from a `/v1/...` call, which checks the
//! token the operator typed into the page (kept in `sessionStorage`, sent
//! as `Authorization: Bearer`). The page finds the API relative to its own
//! address (`../v1/...`), so it also works behind a proxy that mounts the
//! API under a path prefix.
//!
//! # Headers
//!
//! The page shows task payloads, results, errors and logs: text that
//! handlers and submitters choose. The scripts only ever insert it as text
//! (`textContent`), never as markup, and every response carries a strict
//! policy so that a mistake there still cannot run a script:
//!
//! | header | why |
//! |---|---|
//! | `Content-Security-Policy` [`CSP`] | scripts, styles, images and connections from this origin only, no inline script or style element, no plugins, no framing (clickjacking), no `<base>` or form targets elsewhere |
//! | `X-Content-Type-Options: nosniff` | a file is only ever what its `Content-Type` says |
//! | `Referrer-Policy: no-referrer` | task ids in the address never leave in a `Referer` |
//! | `Cache-Control: no-cache` + `ETag` | a browser revalidates (304) and so never runs the assets of an older binary against a newer API |

use std::sync::OnceLock;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::extract::ApiPath;
use crate::base::ErrorCode;

/// The policy of every dashboard response. `default-src 'self'` covers
/// scripts, styles, images and `fetch`; what it does not cover is named.
const CSP: &str = "default-src 'self'; base-uri 'none'; form-action 'none'; \
                       frame-ancestors 'none'; object-src 'none'";

/// One embedded file.
struct Asset {
    /// Its name under `/ui/`.
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

/// Every file of the dashboard; `index.html` is also `/ui/`.
const ASSETS: &[Asset] = &[
    asset(
        "index.html",
        "text/html; charset=utf-8",
        include_bytes!("../../ui/index.html"),
    ),
    asset(
        "style.css",
        "text/css; charset=utf-8",
        include_bytes!("../../ui/style.css"),
    ),
    asset("app.js", JS, include_bytes!("../../ui/app.js")),
    asset("api.js", JS, include_bytes!("../../ui/api.js")),
    asset("dom.js", JS, include_bytes!("../../ui/dom.js")),
    asset("chart.js", JS, include_bytes!("../../ui/chart.js")),
    asset("pages.js", JS, include_bytes!("../../ui/pages.js")),
    asset(
        "favicon.svg",
        "image/svg+xml",
        include_bytes!("../../ui/favicon.svg"),
    ),
];

/// The type modules must be served with (a browser refuses a module of
/// another type under `nosniff`).
const JS: &str = "text/javascript; charset=utf-8";

const fn asset(name: &'static str, content_type: &'static str, body: &'static [u8]) -> Asset {
    Asset {
        name,
        content_type,
        body,
    }
}

/// The dashboard's routes. They take no state, so they merge into the
/// API's router whatever its state.
pub(super) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(redirect))
        .route("/ui/", get(index))
        .route("/ui/{file}", get(file))
}

/// `/ui` → `/ui/`, so that the page's relative addresses resolve under it.
/// The location is relative too (`ui/`), which keeps a path prefix a proxy
/// put in front.
async fn redirect() -> Response {
    let mut response = StatusCode::PERMANENT_REDIRECT.into_response();
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("ui/"));
    secure(response.headers_mut());
    response
}

async fn index(headers: HeaderMap) -> Response {
    serve(0, &headers)
}

async fn file(ApiPath(name): ApiPath<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().position(|a| a.name == name) {
        Some(i) => serve(i, &headers),
        None => {
            let mut response =
                ApiError::new(ErrorCode::NotFound, "no such file of the dashboard").into_response();
            secure(response.headers_mut());
            response
        }
    }
}

/// `ASSETS[i]`, or 304 when the browser's copy is current.
fn serve(i: usize, request: &HeaderMap) -> Response {
    let asset = &ASSETS[i];
    let etag = &etags()[i];
    let fresh = request
        .get(header::IF_NONE_MATCH)
        .is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        asset.body.into_response()
    };
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    h.insert(header::ETAG, etag.clone());
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    secure(h);
    response
}

/// The security headers of every dashboard response (see the module
/// documentation).
fn secure(h: &mut HeaderMap) {
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

/// Each asset's `ETag`: a prefix of its SHA-256, computed once.
fn etags() -> &'static [HeaderValue] {
    static ETAGS: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    ETAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| {
                let digest = Sha256::digest(a.body);
                let tag = format!("\"{}\"", hex::encode(&digest[..12]));
                HeaderValue::from_str(&tag).unwrap_or(HeaderValue::from_static("\"0\""))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_comes_first_and_names_are_unique() {
        assert_eq!(ASSETS[0].name, "index.html");
        for (i, a) in ASSETS.iter().enumerate() {
            assert!(
                ASSETS[i + 1..].iter().all(|b| b.name != a.name),
                "{} twice",
                a.name
            );
        }
    }

    /// Every file the page refers to is served, and no markup holds an
    /// inline script or style, which the policy would block.
    #[test]
    fn the_page_refers_only_to_served_files_and_has_nothing_inline() {
        let html = std::str::from_utf8(ASSETS[0].body).expect("UTF-8");
        for attr in ["src=\"", "href=\""] {
            for part in html.split(attr).skip(1) {
                let target = part.split('"').next().unwrap_or_default();
                if target.starts_with('#') {
                    continue;
                }
                assert!(
                    ASSETS.iter().any(|a| a.name == target),
                    "index.html refers to {target:?}, which is not served"
                );
            }
        }
        assert!(!html.contains("<script>"), "an inline script");
        assert!(!html.contains("<style"), "an inline style element");
        assert!(!html.contains("style=\""), "an inline style attribute");
        let handler = html.split(" on").skip(1).find(|rest| {
            let name: String = rest.chars().take_while(char::is_ascii_lowercase).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(handler.is_none(), "an inline event handler: on{handler:?}");
        for a in ASSETS.iter().filter(|a| a.name.ends_with(".js")) {
            let js = std::str::from_utf8(a.body).expect("UTF-8");
            assert!(!js.contains("innerHTML"), "{}: markup from text", a.name);
            for part in js.split("from './").skip(1) {
                let target = part.split('\'').next().unwrap_or_default();
                assert!(
                    ASSETS.iter().any(|b| b.name == target),
                    "{} imports {target:?}, which is not served",
                    a.name
                );
            }
        }
    }
}
