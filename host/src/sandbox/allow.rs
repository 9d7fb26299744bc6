//! The allow-list of a handler's outbound HTTP: `scheme://host[:port]`
//! patterns, whether one list covers another, and which addresses are
//! public. `http.rs` applies it where each request is sent and each socket
//! opened.

use std::fmt;
use std::net::IpAddr;

/// Which scheme a pattern allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SchemeMatch {
    Http,
    Https,
    Any,
}

/// Which hosts a pattern allows.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostMatch {
    /// One host name (lowercase).
    Name(String),
    /// Every host under a domain: `*.example.com` is stored as
    /// `.example.com`.
    Suffix(String),
    /// One address, written as such.
    Ip(IpAddr),
}

/// Which ports a pattern allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PortMatch {
    /// No port in the pattern: the scheme's own (80, 443).
    Default,
    /// `:*`.
    Any,
    /// `:<n>`.
    Exact(u16),
}

/// One `scheme://host[:port]` pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostPattern {
    scheme: SchemeMatch,
    host: HostMatch,
    port: PortMatch,
    text: String,
}

/// The hosts one handler may send requests to: patterns of the form
/// `scheme://host[:port]`, where the scheme is `http`, `https` or `*`, the
/// host a name, `*.domain` (every name under it), or an address (`[...]` for
/// IPv6), and the port a number or `*` (absent: the scheme's default).
///
/// A host name is reached only at public addresses; a loopback, private or
/// link-local address must be named by the pattern itself (an address, or
/// `localhost`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    patterns: Vec<HostPattern>,
}

/// A pattern that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allow-list pattern {pattern:?}: {reason}")]
pub struct PatternError {
    pattern: String,
    reason: &'static str,
}

impl AllowList {
    /// Parse comma-separated patterns (blanks around them ignored).
    pub fn parse(text: &str) -> Result<AllowList, PatternError> {
        let patterns = text
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(HostPattern::parse)
            .collect::<Result<_, _>>()?;
        Ok(AllowList { patterns })
    }

    /// This list with `other`'s patterns too.
    pub fn extend(&mut self, other: AllowList) {
        self.patterns.extend(other.patterns);
    }

    /// Whether no host is allowed.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The first pattern of `other` that allows a request this list does
    /// not; `None` when this list allows everything `other` does. An API
    /// token's deploy grant uses it to bound the allow-lists it may give.
    ///
    /// Decided per pattern, conservatively: a pattern is covered by one
    /// pattern of this list whose scheme, port and host each take in its
    /// own (`*://` takes either scheme, `:*` every port, `*.example.com`
    /// every name under it, `*.a.example.com` included; an address or a
    /// name only itself).
    pub fn uncovered<'a>(&self, other: &'a AllowList) -> Option<&'a str> {
        other
            .patterns
            .iter()
            .find(|p| !self.patterns.iter().any(|mine| mine.covers(p)))
            .map(|p| p.text.as_str())
    }

    /// The decision for a request to `scheme://host:port`; `None` when no
    /// pattern allows it. `Some(true)` when the matching pattern names the
    /// address (so it may be a private one).
    pub(super) fn allows(&self, scheme: &str, host: &str, port: u16) -> Option<bool> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip: Option<IpAddr> = host.parse().ok();
        let host = host.to_ascii_lowercase();
        self.patterns.iter().find_map(|p| {
            let scheme_ok = match p.scheme {
                SchemeMatch::Any => scheme == "http" || scheme == "https",
                SchemeMatch::Http => scheme == "http",
                SchemeMatch::Https => scheme == "https",
            };
            let port_ok = match p.port {
                PortMatch::Any => true,
                PortMatch::Default => port == default_port(scheme),
                PortMatch::Exact(want) => port == want,
            };
            let (host_ok, explicit) = match (&p.host, ip) {
                (HostMatch::Ip(want), Some(ip)) => (*want == ip, true),
                (HostMatch::Ip(_), None) | (_, Some(_)) => (false, false),
                (HostMatch::Name(name), None) => (*name == host, name == "localhost"),
                (HostMatch::Suffix(suffix), None) => (host.ends_with(suffix.as_str()), false),
            };
            (scheme_ok && port_ok && host_ok).then_some(explicit)
        })
    }
}

impl fmt::Display for AllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let texts: Vec<&str> = self.patterns.iter().map(|p| p.text.as_str()).collect();
        f.write_str(&texts.join(","))
    }
}

/// The port of `scheme` when a URL names none.
pub(super) fn default_port(scheme: &str) -> u16 {
    if scheme == "https" { 443 } else { 80 }
}

impl HostPattern {
    /// Whether every request `other` allows, this pattern allows too.
    fn covers(&self, other: &HostPattern) -> bool {
        let scheme = self.scheme == SchemeMatch::Any || self.scheme == other.scheme;
        let port = self.port == PortMatch::Any || self.port == other.port;
        let host = match (&self.host, &other.host) {
            (HostMatch::Suffix(mine), HostMatch::Name(name) | HostMatch::Suffix(name)) => {
                name.ends_with(mine.as_str())
            }
            (mine, theirs) => mine == theirs,
        };
        scheme && port && host
    }

    fn parse(text: &str) -> Result<HostPattern, PatternError> {
        let error = |reason| PatternError {
            pattern: text.to_owned(),
            reason,
        };
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| error("start it with http://, https:// or *://"))?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => SchemeMatch::Http,
            "https" => SchemeMatch::Https,
            "*" => SchemeMatch::Any,
            _ => return Err(error("the scheme must be http, https or *")),
        };
        if rest.contains(['/', '?', '#', '@']) {
            return Err(error("give a scheme, a host and a port only, no path"));
        }
        // `[v6]:port`, `[v6]`, `host:port`, `host`.
        let (host, port) = match rest.strip_prefix('[') {
            Some(v6) => {
                let (addr, after) = v6
                    .split_once(']')
                    .ok_or_else(|| error("an IPv6 address needs its closing ]"))?;
                let port = match after {
                    "" => None,
                    p => Some(p.strip_prefix(':').ok_or_else(|| error("bad port"))?),
                };
                (addr, port)
            }
            None => match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            },
        };
        let port = match port {
            None => PortMatch::Default,
            Some("*") => PortMatch::Any,
            Some(p) => PortMatch::Exact(
                p.parse::<u16>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| error("the port must be 1 to 65535 or *"))?,
            ),
        };
        let host = if let Ok(ip) = host.parse::<IpAddr>() {
            HostMatch::Ip(ip)
        } else if let Some(domain) = host.strip_prefix("*.") {
            if !valid_name(domain) {
                return Err(error("not a host name after *."));
            }
            HostMatch::Suffix(format!(".{}", domain.to_ascii_lowercase()))
        } else if valid_name(host) {
            HostMatch::Name(host.to_ascii_lowercase())
        } else {
            return Err(error(
                "not a host name or an address (a bare * is not allowed)",
            ));
        };
        Ok(HostPattern {
            scheme,
            host,
            port,
            text: text.to_owned(),
        })
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Whether `ip` is an address on the public internet: not loopback,
/// private, link-local (cloud metadata services live there), shared
/// (CGNAT), unspecified, multicast, broadcast or documentation.
pub(super) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(list: &str, scheme: &str, host: &str, port: u16) -> Option<bool> {
        AllowList::parse(list)
            .expect("parses")
            .allows(scheme, host, port)
    }

    #[test]
    fn a_list_covers_the_patterns_it_takes_in_and_names_the_first_it_does_not() {
        let list = |text| AllowList::parse(text).expect("parses");
        let grant = list("https://*.example.com, *://10.0.0.1:*, http://localhost:8080");
        for inside in [
            "https://api.example.com",
            "https://*.a.example.com",
            "http://10.0.0.1:9000, https://10.0.0.1",
            "http://localhost:8080",
            "",
        ] {
            assert_eq!(grant.uncovered(&list(inside)), None, "{inside}");
        }
        for (outside, named) in [
            (
                "https://api.example.com, http://api.example.com",
                "http://api.example.com",
            ),
            ("https://example.com", "https://example.com"),
            (
                "https://api.example.com:8443",
                "https://api.example.com:8443",
            ),
            ("http://10.0.0.2:80", "http://10.0.0.2:80"),
            ("http://localhost:*", "http://localhost:*"),
            ("*://*.example.com", "*://*.example.com"),
        ] {
            assert_eq!(grant.uncovered(&list(outside)), Some(named), "{outside}");
        }
    }

    #[test]
    fn patterns_match_scheme_host_and_port() {
        let list = "https://api.example.com, http://127.0.0.1:*, *://*.corp.example:8443";
        assert_eq!(allows(list, "https", "api.example.com", 443), Some(false));
        assert_eq!(allows(list, "https", "API.Example.com", 443), Some(false));
        assert_eq!(allows(list, "http", "api.example.com", 80), None, "scheme");
        assert_eq!(allows(list, "https", "api.example.com", 8443), None, "port");
        assert_eq!(allows(list, "https", "evil.example.com", 443), None);
        assert_eq!(allows(list, "http", "127.0.0.1", 9999), Some(true));
        assert_eq!(allows(list, "http", "127.0.0.2", 9999), None);
        assert_eq!(allows(list, "http", "a.b.corp.example", 8443), Some(false));
        assert_eq!(
            allows(list, "https", "corp.example", 8443),
            None,
            "not under"
        );
        assert_eq!(
            allows("http://[::1]:8080", "http", "[::1]", 8080),
            Some(true)
        );
        assert_eq!(
            allows("http://localhost:*", "http", "localhost", 1),
            Some(true)
        );
        // A name pattern never matches an address that happens to end
        // like it.
        assert_eq!(allows("http://*.1:*", "http", "127.0.0.1", 80), None);
        assert_eq!(allows("", "https", "api.example.com", 443), None);
    }

    #[test]
    fn bad_patterns_say_why() {
        for bad in [
            "api.example.com",
            "ftp://x.example",
            "https://x.example/path",
            "https://*",
            "https://x.example:0",
            "https://x.example:http",
            "https://user@x.example",
            "http://[::1",
        ] {
            assert!(AllowList::parse(bad).is_err(), "{bad} accepted");
        }
        let list = AllowList::parse(" https://a.example , http://10.0.0.1:81 ").expect("parses");
        assert_eq!(list.to_string(), "https://a.example,http://10.0.0.1:81");
    }

    #[test]
    fn only_public_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            let ip: IpAddr = private.parse().expect("an address");
            assert!(!is_public(ip), "{private} counted as public");
        }
        for public in ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111"] {
            let ip: IpAddr = public.parse().expect("an address");
            assert!(is_public(ip), "{public} counted as private");
        }
    }
}
