//! The egress allowlist grammar and the built-in list.
//!
//! Entries: `host` (ports 80 and 443), `.suffix` (the host and every
//! subdomain, at least two labels — `.com` is refused), `host:port` (that
//! port only). A host may be an IPv4 literal or a bracketed IPv6 literal;
//! naming a literal is the only way to admit one.

use std::fmt;
use std::net::IpAddr;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?}: {reason}")]
pub struct EntryError {
    pub entry: String,
    pub reason: String,
}

/// What an entry names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Host(String),
    Suffix(String),
    Ip(IpAddr),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub target: Target,
    /// `None` = 80 and 443.
    pub port: Option<u16>,
}

fn bad(entry: &str, reason: &str) -> EntryError {
    EntryError {
        entry: entry.to_string(),
        reason: reason.to_string(),
    }
}

fn valid_hostname(h: &str) -> bool {
    h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

impl Entry {
    pub fn parse(raw: &str) -> Result<Entry, EntryError> {
        let s = raw.trim();
        if s.is_empty() {
            return Err(bad(raw, "empty entry"));
        }
        if s.contains("://") || s.contains('/') || s.contains('*') || s.contains('@') {
            return Err(bad(
                raw,
                "an entry is host, .suffix or host:port — no scheme, path or wildcard",
            ));
        }
        let lower = s.to_ascii_lowercase();
        // [v6]:port or [v6]
        if let Some(rest) = lower.strip_prefix('[') {
            let (addr, after) = rest.split_once(']').ok_or_else(|| bad(raw, "unclosed ["))?;
            let ip: std::net::Ipv6Addr =
                addr.parse().map_err(|_| bad(raw, "not an IPv6 literal"))?;
            let port = match after {
                "" => None,
                p => Some(parse_port(
                    raw,
                    p.strip_prefix(':')
                        .ok_or_else(|| bad(raw, "junk after ]"))?,
                )?),
            };
            return Ok(Entry {
                target: Target::Ip(IpAddr::V6(ip)),
                port,
            });
        }
        let (host, port) = match lower.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(parse_port(raw, p)?)),
            None => (lower.clone(), None),
        };
        if let Ok(ip) = host.parse::<std::net::Ipv4Addr>() {
            return Ok(Entry {
                target: Target::Ip(IpAddr::V4(ip)),
                port,
            });
        }
        if let Some(suffix) = host.strip_prefix('.') {
            if port.is_some() {
                return Err(bad(
                    raw,
                    "a .suffix entry takes no port; name host:port instead",
                ));
            }
            if !valid_hostname(suffix) {
                return Err(bad(raw, "not a domain suffix"));
            }
            if suffix.split('.').count() < 2 {
                return Err(bad(
                    raw,
                    "a .suffix needs at least two labels (.com would admit a whole TLD)",
                ));
            }
            return Ok(Entry {
                target: Target::Suffix(suffix.to_string()),
                port: None,
            });
        }
        if !valid_hostname(&host) {
            return Err(bad(raw, "not a host name"));
        }
        if host.split('.').count() < 2 {
            return Err(bad(raw, "a host needs at least two labels"));
        }
        if host
            .split('.')
            .next_back()
            .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(bad(raw, "not a host name or an IPv4 literal"));
        }
        Ok(Entry {
            target: Target::Host(host),
            port,
        })
    }

    /// Whether this entry admits `host:port` (host lowercase, IPs in
    /// canonical text form).
    pub fn admits(&self, host: &str, port: u16) -> bool {
        let port_ok = match self.port {
            Some(p) => p == port,
            None => port == 80 || port == 443,
        };
        port_ok
            && match &self.target {
                Target::Host(h) => h == host,
                Target::Suffix(s) => {
                    host == s
                        || host
                            .strip_suffix(s.as_str())
                            .is_some_and(|p| p.ends_with('.'))
                }
                Target::Ip(ip) => {
                    host.trim_start_matches('[')
                        .trim_end_matches(']')
                        .parse::<IpAddr>()
                        .ok()
                        == Some(*ip)
                }
            }
    }

    pub fn names_ip(&self, ip: IpAddr) -> bool {
        self.target == Target::Ip(ip)
    }
}

fn parse_port(raw: &str, p: &str) -> Result<u16, EntryError> {
    match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(bad(raw, "port must be 1 to 65535")),
        Ok(n) => Ok(n),
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = match &self.target {
            Target::Host(h) => h.clone(),
            Target::Suffix(s) => format!(".{s}"),
            Target::Ip(IpAddr::V4(ip)) => ip.to_string(),
            Target::Ip(IpAddr::V6(ip)) => format!("[{ip}]"),
        };
        match self.port {
            Some(p) => write!(f, "{host}:{p}"),
            None => write!(f, "{host}"),
        }
    }
}

/// Parses a list (the deployment list or a run's `egressAllow`); the first
/// malformed entry is the error.
pub fn parse_list<S: AsRef<str>>(items: &[S]) -> Result<Vec<Entry>, EntryError> {
    items.iter().map(|s| Entry::parse(s.as_ref())).collect()
}

/// The entry that would admit `host:port`, as a user would write it.
pub fn entry_for(host: &str, port: u16) -> String {
    let h = match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => format!("[{ip}]"),
        _ => host.to_string(),
    };
    if port == 80 || port == 443 {
        h
    } else {
        format!("{h}:{port}")
    }
}

/// The built-in list: package ecosystems and code hosts an agent needs.
/// "two-way" marks hosts where the registry serves uploads on the same
/// name as downloads: allowing the install allows the upload, knowingly.
/// Where a registry publishes on its own hostname, only the download host
/// is here. Deliberately absent:
/// - `storage.googleapis.com`: the Flutter SDK fetches engine artifacts from
///   it, but a generic object store is an exfiltration channel with a
///   package manager's excuse; opt in per run.
/// - `registry.k8s.io`: redirects even manifests to regional `*.pkg.dev` or
///   `prod-registry-k8s-io-*` S3 buckets — there is no single host to allow.
/// - `aka.ms`: a redirector to anywhere on Microsoft's estate.
pub const BUILTIN: &[&str] = &[
    // npm: registry metadata and tarballs; two-way (npm publish uses it too).
    "registry.npmjs.org",
    // Yarn classic's mirror of the npm registry; two-way like npm.
    "registry.yarnpkg.com",
    // Yarn berry releases and plugins.
    "repo.yarnpkg.com",
    // Node.js release tarballs and headers (nvm, corepack, node-gyp).
    "nodejs.org",
    // PyPI simple index and JSON API (uploads go to upload.pypi.org, absent).
    "pypi.org",
    // PyPI wheel and sdist downloads.
    "files.pythonhosted.org",
    // Go module proxy.
    "proxy.golang.org",
    // Go checksum database.
    "sum.golang.org",
    // golang.org/x vanity import paths.
    "golang.org",
    // go.dev toolchain downloads and redirects.
    "go.dev",
    // Go toolchain archives (go.dev/dl redirects here).
    "dl.google.com",
    // crates.io sparse index (publishing is the crates.io API host, absent).
    "index.crates.io",
    // crates.io crate downloads.
    "static.crates.io",
    // rustup toolchains and components.
    "static.rust-lang.org",
    // rustup installer script.
    "sh.rustup.rs",
    // RubyGems API, compact index and gems; two-way (gem push uses it).
    "rubygems.org",
    // RubyGems compact index host.
    "index.rubygems.org",
    // Maven Central downloads (publishing goes through Sonatype, absent).
    "repo.maven.apache.org",
    // Maven Central's other name.
    "repo1.maven.org",
    // Gradle wrapper distributions.
    "services.gradle.org",
    // Gradle distribution downloads (services.gradle.org redirects here).
    "downloads.gradle.org",
    // Gradle plugin portal; two-way (plugin publishing uses it).
    "plugins.gradle.org",
    // Gradle plugin portal artifacts.
    "plugins-artifacts.gradle.org",
    // Adoptium API for Gradle JDK toolchains (binaries come from GitHub).
    "api.adoptium.net",
    // google() Maven repository (Android, AndroidX).
    "maven.google.com",
    // Composer metadata (publishing is packagist.org, absent).
    "repo.packagist.org",
    // NuGet v3 feed and packages (publishing is www.nuget.org, absent).
    "api.nuget.org",
    // dotnet-install script.
    "dot.net",
    // .NET SDK and runtime builds for dotnet-install.
    "builds.dotnet.microsoft.com",
    // Older .NET builds CDN still used by dotnet-install.
    "dotnetcli.azureedge.net",
    // Hex packages (publishing is the hex.pm API, absent).
    "repo.hex.pm",
    // Hex and Elixir/OTP builds for mix local.hex and setup scripts.
    "builds.hex.pm",
    // pub.dev packages and API; two-way (dart pub publish uses it).
    "pub.dev",
    // Hackage packages and index; two-way (cabal upload uses it).
    "hackage.haskell.org",
    // GHC, cabal and stack binaries for ghcup.
    "downloads.haskell.org",
    // ghcup installer.
    "get-ghcup.haskell.org",
    // Debian packages.
    "deb.debian.org",
    // Debian security updates.
    "security.debian.org",
    // Ubuntu archive and its country mirrors (xx.archive.ubuntu.com).
    ".archive.ubuntu.com",
    // Ubuntu security updates.
    "security.ubuntu.com",
    // Ubuntu ports (arm64 and other architectures).
    "ports.ubuntu.com",
    // Alpine packages.
    "dl-cdn.alpinelinux.org",
    // GitHub git over https, releases; two-way (git push).
    "github.com",
    // GitHub source archives.
    "codeload.github.com",
    // GitHub raw file content.
    "raw.githubusercontent.com",
    // GitHub release assets and LFS objects.
    "objects.githubusercontent.com",
    // GitHub release asset downloads (newer host).
    "release-assets.githubusercontent.com",
    // GitHub API (release lookups by installers).
    "api.github.com",
    // GitLab git over https; two-way (git push).
    "gitlab.com",
    // Bitbucket git over https; two-way (git push).
    "bitbucket.org",
    // Codeberg git over https; two-way (git push).
    "codeberg.org",
    // Docker Hub registry API; two-way (docker push).
    "registry-1.docker.io",
    // Docker Hub token service for anonymous pulls.
    "auth.docker.io",
    // Docker Hub layer CDN.
    "production.cloudflare.docker.com",
    // GitHub Container Registry; two-way (docker push).
    "ghcr.io",
    // GHCR layer downloads.
    "pkg-containers.githubusercontent.com",
    // Quay registry; two-way (docker push).
    "quay.io",
    // Quay layer CDN (cdn01.quay.io, cdn02…).
    ".quay.io",
    // Microsoft Container Registry (pull only for the public).
    "mcr.microsoft.com",
    // MCR layer storage (eastus.data.mcr.microsoft.com…).
    ".data.mcr.microsoft.com",
];

/// The built-in list, parsed.
pub fn builtin() -> Vec<Entry> {
    BUILTIN
        .iter()
        .filter_map(|s| Entry::parse(s).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar() {
        let e = Entry::parse("RubyGems.org").expect("host");
        assert!(e.admits("rubygems.org", 443) && e.admits("rubygems.org", 80));
        assert!(!e.admits("rubygems.org", 8080) && !e.admits("evil.rubygems.org", 443));
        let s = Entry::parse(".hex.pm").expect("suffix");
        assert!(
            s.admits("hex.pm", 443) && s.admits("repo.hex.pm", 443) && s.admits("a.b.hex.pm", 80)
        );
        assert!(!s.admits("xhex.pm", 443) && !s.admits("hex.pm.evil.com", 443));
        let p = Entry::parse("forge.example.com:49152").expect("port");
        assert!(p.admits("forge.example.com", 49152) && !p.admits("forge.example.com", 443));
        let ip = Entry::parse("10.1.2.3:8080").expect("ip");
        assert!(ip.admits("10.1.2.3", 8080) && ip.names_ip("10.1.2.3".parse().expect("ip")));
        let v6 = Entry::parse("[fd00::1]:443").expect("v6");
        assert!(v6.admits("fd00::1", 443));
        assert_eq!(v6.to_string(), "[fd00::1]:443");
        assert_eq!(s.to_string(), ".hex.pm");
    }

    #[test]
    fn malformed_entries_name_themselves() {
        for (raw, why) in [
            (".com", "two labels"),
            ("", "empty"),
            ("https://x.com", "no scheme"),
            ("*.x.com", "wildcard"),
            ("x.com:0", "port"),
            ("x.com:99999", "port"),
            ("localhost", "two labels"),
            ("-x.com", "host name"),
            (".x.com:443", "no port"),
            ("1.2.3.999", "IPv4"),
            ("[::1", "unclosed"),
        ] {
            let e = Entry::parse(raw).expect_err(raw);
            assert_eq!(e.entry, raw);
            assert!(e.reason.contains(why), "{raw}: {}", e.reason);
        }
    }

    #[test]
    fn the_builtin_list_parses_and_leaves_out_the_refusals() {
        assert_eq!(builtin().len(), BUILTIN.len());
        let admits = |h: &str| builtin().iter().any(|e| e.admits(h, 443));
        for h in [
            "registry.npmjs.org",
            "files.pythonhosted.org",
            "static.crates.io",
            "us.archive.ubuntu.com",
            "cdn03.quay.io",
        ] {
            assert!(admits(h), "{h}");
        }
        for h in [
            "storage.googleapis.com",
            "registry.k8s.io",
            "aka.ms",
            "crates.io",
            "hex.pm",
            "www.nuget.org",
            "packagist.org",
            "upload.pypi.org",
        ] {
            assert!(!admits(h), "{h} must be absent");
        }
    }

    #[test]
    fn the_entry_that_would_admit() {
        assert_eq!(entry_for("example.com", 443), "example.com");
        assert_eq!(entry_for("example.com", 8443), "example.com:8443");
        assert_eq!(entry_for("fd00::1", 22), "[fd00::1]:22");
    }
}
