//! Admin authorization: `Authorization: Bearer $DTQ_ADMIN_TOKEN`.
//!
//! Without a configured token the admin routes are disabled (403), so a
//! deployment that never set one cannot be administered by anyone.

use axum::http::{HeaderMap, StatusCode, header};

use super::error::ApiError;

/// Check the request's bearer token against the configured one.
pub(super) fn require_admin(headers: &HeaderMap, token: Option<&str>) -> Result<(), ApiError> {
    let Some(expected) = token.filter(|t| !t.is_empty()) else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "ADMIN_DISABLED",
            "admin routes are disabled: no admin token is configured (DTQ_ADMIN_TOKEN)",
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if constant_time_eq(given.as_bytes(), expected.as_bytes()) => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "this route needs `Authorization: Bearer <admin token>`",
        )),
    }
}

/// Compare without an early exit, so the time taken does not tell how many
/// leading bytes of a guess were right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_exactly() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
    }
}
