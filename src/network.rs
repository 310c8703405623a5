//! The daemon's side of the network tiers: its two bridges, nftables, a
//! veth per networked run, the per-run egress proxies, and start-up cleanup
//! of whatever a crashed daemon left behind.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use sbx_netns::firewall::{self, DaemonRules};
use sbx_netns::ipam::{self, Subnet};
use sbx_netns::links::{self, Links};
use sbx_netns::names::{Names, Tier};

use crate::egress::allowlist::{self, Entry};
use crate::egress::proxy::{self, Policy};

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("links")]
    Links(#[from] links::LinkError),
    #[error("nftables")]
    Firewall(#[from] firewall::FirewallError),
    #[error("addresses")]
    Ipam(#[from] ipam::IpamError),
    #[error("proxy listener on {addr}")]
    Proxy {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no free proxy port in {0}-{1}")]
    NoPort(u16, u16),
    #[error("enable IPv4 forwarding")]
    Forwarding(#[source] std::io::Error),
}

/// A run's place on the network, persisted with the run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunNet {
    pub tier: Tier,
    pub ip: Ipv4Addr,
    pub proxy_port: Option<u16>,
    /// The run's own `egressAllow` entries as given.
    pub egress_allow: Vec<String>,
}

/// The tiers' plan is fixed at start; the bridges and tables are made on
/// first use, so a daemon that only ever runs `none` touches no link.
pub struct Network {
    pub names: Names,
    pub allow: Subnet,
    pub open: Subnet,
    pub proxy_ports: (u16, u16),
    /// Built-in + deployment entries.
    base_entries: Vec<Entry>,
    live: tokio::sync::OnceCell<Live>,
}

struct Live {
    links: Links,
    bridges: (u32, u32),
    /// Never dialed by a proxy: this host's addresses and the sandbox subnets.
    forbidden: Vec<(IpAddr, u8)>,
}

/// Defaults derived from the daemon key, so two daemons differ.
pub fn default_subnet(key: &str) -> Subnet {
    let k = u32::from_str_radix(&key[..key.len().min(8)], 16).unwrap_or(0);
    let second = 200 + (k % 50) as u8;
    let third = (((k >> 8) % 16) * 16) as u8;
    Subnet {
        network: Ipv4Addr::new(10, second, third, 0),
        prefix: 20,
    }
}

pub fn default_proxy_ports(key: &str) -> (u16, u16) {
    let k = u32::from_str_radix(&key[..key.len().min(8)], 16).unwrap_or(0);
    let base = 20000 + ((k >> 16) % 40) as u16 * 1000;
    (base, base + 999)
}

fn local_addresses() -> Vec<(IpAddr, u8)> {
    let mut out = Vec::new();
    if let Ok(addrs) = nix::ifaddrs::getifaddrs() {
        for a in addrs {
            if let Some(sa) = a.address {
                if let Some(v4) = sa.as_sockaddr_in() {
                    out.push((IpAddr::V4(v4.ip()), 32));
                } else if let Some(v6) = sa.as_sockaddr_in6() {
                    out.push((IpAddr::V6(v6.ip()), 128));
                }
            }
        }
    }
    out
}

impl Network {
    /// Plans the tiers; nothing is created yet.
    pub fn new(
        key: &str,
        subnet: Option<Subnet>,
        proxy_ports: Option<(u16, u16)>,
        deployment: Vec<Entry>,
    ) -> Result<Network, NetworkError> {
        let names = Names::new(key);
        let (allow, open) = subnet
            .unwrap_or_else(|| default_subnet(&names.key))
            .halves()?;
        let proxy_ports = proxy_ports.unwrap_or_else(|| default_proxy_ports(&names.key));
        let mut base_entries = allowlist::builtin();
        base_entries.extend(deployment);
        Ok(Network {
            names,
            allow,
            open,
            proxy_ports,
            base_entries,
            live: tokio::sync::OnceCell::new(),
        })
    }

    /// The bridges and the daemon table, set up once (idempotently).
    async fn live(&self) -> Result<&Live, NetworkError> {
        self.live
            .get_or_try_init(|| async {
                let links = Links::connect()?;
                let names = &self.names;
                let a = links.ensure_bridge(&names.bridge(Tier::Allowlist), self.allow.gateway(), self.allow.prefix).await?;
                let o = links.ensure_bridge(&names.bridge(Tier::Open), self.open.gateway(), self.open.prefix).await?;
                let rules = DaemonRules {
                    table: names.table(),
                    allow_bridge: names.bridge(Tier::Allowlist),
                    allow_gateway: self.allow.gateway(),
                    open_bridge: names.bridge(Tier::Open),
                    open_subnet: self.open,
                    proxy_ports: self.proxy_ports,
                };
                tokio::task::spawn_blocking(move || firewall::apply_daemon(&rules))
                    .await
                    .map_err(|e| links::LinkError::Missing(e.to_string()))??;
                // The open tier routes out of this host.
                std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(NetworkError::Forwarding)?;
                let mut forbidden = local_addresses();
                forbidden.push((IpAddr::V4(self.allow.network), self.allow.prefix));
                forbidden.push((IpAddr::V4(self.open.network), self.open.prefix));
                tracing::info!(allowlist = %self.allow, open = %self.open, proxy_ports = ?self.proxy_ports, "network tiers ready");
                Ok::<Live, NetworkError>(Live { links, bridges: (a, o), forbidden })
            })
            .await
    }

    /// Removes the bridges and the daemon table (when no networked run is left).
    pub async fn teardown(&self) {
        let Ok(links) = Links::connect() else { return };
        for tier in [Tier::Allowlist, Tier::Open] {
            if let Err(e) = links.delete(&self.names.bridge(tier)).await {
                tracing::error!(error = %e, "delete bridge");
            }
        }
        let table = self.names.table();
        let _ = tokio::task::spawn_blocking(move || firewall::delete_daemon_table(&table)).await;
    }

    pub fn subnet(&self, tier: Tier) -> Subnet {
        match tier {
            Tier::Allowlist => self.allow,
            Tier::Open => self.open,
        }
    }

    pub fn allocate_ip(
        &self,
        tier: Tier,
        used: &BTreeSet<Ipv4Addr>,
    ) -> Result<Ipv4Addr, NetworkError> {
        Ok(ipam::allocate(self.subnet(tier), used)?)
    }

    pub fn allocate_port(&self, used: &BTreeSet<u16>) -> Result<u16, NetworkError> {
        (self.proxy_ports.0..=self.proxy_ports.1)
            .find(|p| !used.contains(p))
            .ok_or(NetworkError::NoPort(self.proxy_ports.0, self.proxy_ports.1))
    }

    /// The run's view of the world: its resolv.conf.
    pub fn resolv_conf(tier: Option<Tier>) -> String {
        match tier {
            Some(Tier::Open) => {
                let host = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
                let servers: Vec<&str> = host
                    .lines()
                    .filter_map(|l| l.strip_prefix("nameserver"))
                    .map(str::trim)
                    .filter(|s| s.parse::<IpAddr>().is_ok_and(|ip| !ip.is_loopback()))
                    .collect();
                if servers.is_empty() {
                    "# the host's resolver is not reachable from runs\n".to_string()
                } else {
                    servers
                        .iter()
                        .map(|s| format!("nameserver {s}\n"))
                        .collect()
                }
            }
            Some(Tier::Allowlist) => {
                "# names are resolved by the egress proxy (HTTP_PROXY)\n".to_string()
            }
            None => "# no network\n".to_string(),
        }
    }

    /// Proxy variables for an allowlist run.
    pub fn proxy_env(&self, net: &RunNet) -> Vec<(String, String)> {
        let Some(port) = net.proxy_port else {
            return Vec::new();
        };
        let url = format!("http://{}:{port}", self.allow.gateway());
        let mut env: Vec<(String, String)> =
            ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
                .iter()
                .map(|k| (k.to_string(), url.clone()))
                .collect();
        for k in ["NO_PROXY", "no_proxy"] {
            env.push((k.to_string(), "localhost,127.0.0.1".to_string()));
        }
        env
    }

    /// Wires a run's network namespace (the init's, `pid`) to its bridge.
    pub async fn attach(&self, run_id: &str, net: &RunNet, pid: u32) -> Result<(), NetworkError> {
        let live = self.live().await?;
        let (veth, peer) = (self.names.veth(run_id), self.names.peer(run_id));
        let bridge = match net.tier {
            Tier::Allowlist => live.bridges.0,
            Tier::Open => live.bridges.1,
        };
        let subnet = self.subnet(net.tier);
        let result = async {
            live.links.attach(bridge, &veth, &peer, pid).await?;
            let (ip, gw) = (net.ip, (net.tier == Tier::Open).then(|| subnet.gateway()));
            let p = peer.clone();
            tokio::task::spawn_blocking(move || {
                links::configure_inside(pid, &p, ip, subnet.prefix, gw)
            })
            .await
            .map_err(|e| links::LinkError::Missing(e.to_string()))??;
            let (table, v) = (self.names.run_table(run_id), veth.clone());
            tokio::task::spawn_blocking(move || firewall::apply_run(&table, &v, ip))
                .await
                .map_err(|e| links::LinkError::Missing(e.to_string()))??;
            Ok::<(), NetworkError>(())
        }
        .await;
        if result.is_err() {
            self.detach(run_id).await;
        }
        result
    }

    /// Removes a run's link and table; idempotent, logs what it cannot do.
    pub async fn detach(&self, run_id: &str) {
        match Links::connect() {
            Ok(links) => {
                if let Err(e) = links.delete(&self.names.veth(run_id)).await {
                    tracing::error!(run = run_id, error = %e, "delete veth");
                }
            }
            Err(e) => tracing::error!(run = run_id, error = %e, "netlink"),
        }
        let table = self.names.run_table(run_id);
        let r = tokio::task::spawn_blocking(move || firewall::delete_run_table(&table)).await;
        if let Ok(Err(e)) = r {
            tracing::error!(run = run_id, error = %e, "delete run table");
        }
    }

    /// Starts the run's own proxy on the allowlist gateway.
    pub async fn start_proxy(
        &self,
        run_id: &str,
        net: &RunNet,
    ) -> Result<tokio::task::JoinHandle<()>, NetworkError> {
        let live = self.live().await?;
        let port = net.proxy_port.ok_or(NetworkError::NoPort(0, 0))?;
        let addr = std::net::SocketAddr::from((self.allow.gateway(), port));
        let err = |source| NetworkError::Proxy {
            addr: addr.to_string(),
            source,
        };
        let std_listener = std::net::TcpListener::bind(addr).map_err(err)?;
        std_listener.set_nonblocking(true).map_err(err)?;
        let listener = tokio::net::TcpListener::from_std(std_listener).map_err(err)?;
        let mut entries = self.base_entries.clone();
        // Validated at create; a stored entry that no longer parses is dropped.
        entries.extend(net.egress_allow.iter().filter_map(|e| Entry::parse(e).ok()));
        let policy = Arc::new(Policy {
            run_id: run_id.to_string(),
            entries,
            client: IpAddr::V4(net.ip),
            forbidden: live.forbidden.clone(),
        });
        Ok(tokio::spawn(proxy::serve(listener, policy)))
    }

    /// Removes links and tables of runs that are not live.
    pub async fn reconcile(&self, live: &[String]) {
        let live_veths: BTreeSet<String> = live.iter().map(|id| self.names.veth(id)).collect();
        if let Ok(links) = Links::connect() {
            for tier in [Tier::Allowlist, Tier::Open] {
                let Ok(Some(bridge)) = links.index(&self.names.bridge(tier)).await else {
                    continue;
                };
                match links.ports_of(bridge).await {
                    Ok(ports) => {
                        for n in ports.into_iter().filter(|n| !live_veths.contains(n)) {
                            tracing::info!(link = %n, "removing orphan veth");
                            if let Err(e) = links.delete(&n).await {
                                tracing::error!(link = %n, error = %e, "delete orphan veth");
                            }
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "list bridge ports"),
                }
            }
        }
        let live_tables: BTreeSet<String> =
            live.iter().map(|id| self.names.run_table(id)).collect();
        let prefix = self.names.run_table_prefix();
        match tokio::task::spawn_blocking(firewall::table_names).await {
            Ok(Ok(tables)) => {
                for t in tables
                    .into_iter()
                    .filter(|t| t.starts_with(&prefix) && !live_tables.contains(t))
                {
                    tracing::info!(table = %t, "removing orphan run table");
                    let _ =
                        tokio::task::spawn_blocking(move || firewall::delete_run_table(&t)).await;
                }
            }
            Ok(Err(e)) => tracing::error!(error = %e, "list nftables tables"),
            Err(e) => tracing::error!(error = %e, "list nftables tables"),
        }
    }
}
