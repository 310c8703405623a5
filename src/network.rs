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
    /// The prepared network namespace (and veth) the run took from the pool.
    pub slot: String,
}

/// A prepared network namespace: veth on its bridge, address, routes and
/// anti-spoofing table done, waiting for a run.
struct Slot {
    name: String,
    ip: Ipv4Addr,
}

/// Ready slots per tier, and every address and port held by a slot or a run.
#[derive(Default)]
struct Pool {
    ready: std::collections::HashMap<Tier, Vec<Slot>>,
    ips: BTreeSet<Ipv4Addr>,
    ports: BTreeSet<u16>,
    counter: u64,
}

/// Ready slots kept per tier once the tier has been used.
pub const POOL_SIZE: usize = 2;

/// The tiers' plan is fixed at start; the bridges and tables are made on
/// first use, so a daemon that only ever runs `none` touches no link.
pub struct Network {
    pub names: Names,
    pub allow: Subnet,
    pub open: Subnet,
    pub proxy_ports: (u16, u16),
    /// Built-in + deployment entries.
    base_entries: Vec<Entry>,
    /// Where pinned network namespaces live (`<state>/netns`).
    netns_dir: std::path::PathBuf,
    live: tokio::sync::OnceCell<Live>,
    /// Never held across an await.
    pool: std::sync::Mutex<Pool>,
    /// Ready namespaces with only loopback up, for `none` runs (see
    /// [`Network::take_loopback_only`]). Never held across an await.
    loners: std::sync::Mutex<Vec<std::path::PathBuf>>,
    refilling_loners: std::sync::atomic::AtomicBool,
    /// Set once the pool is drained at shutdown: a top-up still on its way
    /// (see [`Network::created`]) then adds nothing.
    draining: std::sync::atomic::AtomicBool,
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
        netns_dir: std::path::PathBuf,
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
            netns_dir,
            live: tokio::sync::OnceCell::new(),
            pool: std::sync::Mutex::new(Pool::default()),
            loners: std::sync::Mutex::new(Vec::new()),
            refilling_loners: std::sync::atomic::AtomicBool::new(false),
            draining: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The bridges and the daemon table, set up once (idempotently).
    async fn live(&self) -> Result<&Live, NetworkError> {
        self.live
            .get_or_try_init(|| async {
                let links = Links::connect_dedicated()?;
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

    /// The run's own proxy (allowlist tier).
    pub fn proxy_url(&self, net: &RunNet) -> Option<String> {
        net.proxy_port
            .map(|port| format!("http://{}:{port}", self.allow.gateway()))
    }

    /// Proxy variables for an allowlist run.
    pub fn proxy_env(&self, net: &RunNet) -> Vec<(String, String)> {
        let Some(url) = self.proxy_url(net) else {
            return Vec::new();
        };
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

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where a slot's namespace is pinned.
    pub fn netns_path(&self, slot: &str) -> std::path::PathBuf {
        self.netns_dir.join(slot)
    }

    /// Records what live runs hold (at start-up, before any allocation).
    pub fn adopt(&self, nets: &[RunNet]) {
        let mut pool = self.pool();
        for n in nets {
            pool.ips.insert(n.ip);
            if let Some(p) = n.proxy_port {
                pool.ports.insert(p);
            }
        }
    }

    /// A network for a new run: a ready slot of its tier (built now if the
    /// pool is empty) and, for the allowlist tier, a proxy port. The caller
    /// refills the pool ([`Network::created`]) once its run is up.
    pub async fn take(
        self: &Arc<Self>,
        tier: Tier,
        egress_allow: Vec<String>,
    ) -> Result<RunNet, NetworkError> {
        self.live().await?;
        let ready = self.pool().ready.get_mut(&tier).and_then(Vec::pop);
        let slot = match ready {
            Some(s) => s,
            None => self.build_slot(tier).await?,
        };
        let proxy_port = match tier {
            Tier::Allowlist => {
                let port = {
                    let mut pool = self.pool();
                    let port =
                        (self.proxy_ports.0..=self.proxy_ports.1).find(|p| !pool.ports.contains(p));
                    if let Some(p) = port {
                        pool.ports.insert(p);
                    }
                    port
                };
                if port.is_none() {
                    self.release_slot(&slot.name, slot.ip).await;
                    return Err(NetworkError::NoPort(self.proxy_ports.0, self.proxy_ports.1));
                }
                port
            }
            Tier::Open => None,
        };
        Ok(RunNet {
            tier,
            ip: slot.ip,
            proxy_port,
            egress_allow,
            slot: slot.name,
        })
    }

    /// Tops up the ready slots of `tier` in the background. Called once the
    /// run that took a slot is up: building a slot (new namespace, veth,
    /// table: 20-40 ms here, much of it under the kernel's rtnl lock) while
    /// that run is still being created slowed its create by ~15 ms.
    fn refill_soon(self: &Arc<Self>, tier: Tier) {
        let me = self.clone();
        tokio::spawn(async move { me.refill(tier).await });
    }

    fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    async fn refill(&self, tier: Tier) {
        loop {
            if self.draining() || self.pool().ready.get(&tier).map_or(0, Vec::len) >= POOL_SIZE {
                return;
            }
            match self.build_slot(tier).await {
                Ok(s) if self.draining() => return self.release_slot(&s.name, s.ip).await,
                Ok(s) => self.pool().ready.entry(tier).or_default().push(s),
                Err(e) => {
                    tracing::warn!(error = %format!("{:#}", anyhow::Error::from(e)), "refill network pool");
                    return;
                }
            }
        }
    }

    /// Prepares one slot: pinned namespace, veth on the bridge, address and
    /// routes inside, anti-spoofing table.
    async fn build_slot(&self, tier: Tier) -> Result<Slot, NetworkError> {
        let live = self.live().await?;
        let subnet = self.subnet(tier);
        let (name, ip) = {
            let mut pool = self.pool();
            pool.counter += 1;
            let seed = format!(
                "{}-{}-{}",
                std::process::id(),
                pool.counter,
                crate::runs::now_ms()
            );
            let ip = ipam::allocate(subnet, &pool.ips)?;
            pool.ips.insert(ip);
            (self.names.slot(&seed), ip)
        };
        let t0 = std::time::Instant::now();
        let result = async {
            let path = self.netns_path(&name);
            std::fs::create_dir_all(&self.netns_dir)
                .map_err(|e| links::LinkError::Missing(e.to_string()))?;
            let p = path.clone();
            tokio::task::spawn_blocking(move || sbx_netns::create_pinned(&p))
                .await
                .map_err(|e| links::LinkError::Missing(e.to_string()))?
                .map_err(|e| links::LinkError::Missing(format!("{:#}", anyhow::Error::from(e))))?;
            let (veth, peer) = (self.names.veth(&name), self.names.peer(&name));
            let bridge = match tier {
                Tier::Allowlist => live.bridges.0,
                Tier::Open => live.bridges.1,
            };
            live.links.attach(bridge, &veth, &peer, &path).await?;
            let gw = (tier == Tier::Open).then(|| subnet.gateway());
            let (p, pe) = (path.clone(), peer.clone());
            tokio::task::spawn_blocking(move || {
                links::configure_inside(&p, &pe, ip, subnet.prefix, gw)
            })
            .await
            .map_err(|e| links::LinkError::Missing(e.to_string()))??;
            let table = self.names.run_table(&name);
            tokio::task::spawn_blocking(move || firewall::apply_run(&table, &veth, ip))
                .await
                .map_err(|e| links::LinkError::Missing(e.to_string()))??;
            Ok::<(), NetworkError>(())
        }
        .await;
        match result {
            Ok(()) => {
                tracing::debug!(slot = %name, ?tier, %ip, ms = t0.elapsed().as_millis() as u64, "network slot ready");
                Ok(Slot { name, ip })
            }
            Err(e) => {
                self.release_slot(&name, ip).await;
                Err(e)
            }
        }
    }

    /// Removes a slot's namespace, link and table and frees its address.
    async fn release_slot(&self, slot: &str, ip: Ipv4Addr) {
        let path = self.netns_path(slot);
        if let Ok(Err(e)) =
            tokio::task::spawn_blocking(move || sbx_netns::remove_pinned(&path)).await
        {
            tracing::error!(slot, error = %e, "release network namespace");
        }
        match Links::connect() {
            Ok(links) => {
                if let Err(e) = links.delete(&self.names.veth(slot)).await {
                    tracing::error!(slot, error = %e, "delete veth");
                }
            }
            Err(e) => tracing::error!(slot, error = %e, "netlink"),
        }
        let table = self.names.run_table(slot);
        if let Ok(Err(e)) =
            tokio::task::spawn_blocking(move || firewall::delete_run_table(&table)).await
        {
            tracing::error!(slot, error = %e, "delete run table");
        }
        self.pool().ips.remove(&ip);
    }

    /// Gives back everything a dead run held. Call after its processes are
    /// gone. Idempotent.
    pub async fn release(&self, net: &RunNet) {
        self.release_slot(&net.slot, net.ip).await;
        if let Some(p) = net.proxy_port {
            self.pool().ports.remove(&p);
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

    /// Removes namespaces, links and tables that no live run holds (a
    /// crashed daemon's runs and pool).
    pub async fn reconcile(&self, live: &[RunNet]) {
        let slots: BTreeSet<String> = live.iter().map(|n| n.slot.clone()).collect();
        if let Ok(rd) = std::fs::read_dir(&self.netns_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !slots.contains(&name) {
                    tracing::info!(slot = %name, "removing orphan network namespace");
                    let p = e.path();
                    let _ = tokio::task::spawn_blocking(move || sbx_netns::remove_pinned(&p)).await;
                }
            }
        }
        let live_veths: BTreeSet<String> = slots.iter().map(|s| self.names.veth(s)).collect();
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
        let live_tables: BTreeSet<String> = slots.iter().map(|s| self.names.run_table(s)).collect();
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

    /// Drops the ready slots (shutdown with every run stopped).
    pub async fn drain_pool(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
        let slots: Vec<Slot> = self.pool().ready.drain().flat_map(|(_, v)| v).collect();
        for s in slots {
            self.release_slot(&s.name, s.ip).await;
        }
        let loners: Vec<_> = self.loners().drain(..).collect();
        for p in loners {
            let _ = tokio::task::spawn_blocking(move || sbx_netns::remove_pinned(&p)).await;
        }
    }

    fn loners(&self) -> std::sync::MutexGuard<'_, Vec<std::path::PathBuf>> {
        self.loners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A ready network namespace with only loopback up, for a `none` run to
    /// join through its spec; `None` when none waits (the run then gets a
    /// fresh one from libcontainer, as before). Making one — the kernel's
    /// network namespace setup, ~0.45 ms here, plus bringing loopback up
    /// from the shim — was the largest single step of a create. The caller
    /// drops the pin once the run is up or has failed
    /// ([`Network::created`]): from then on the run's processes alone hold
    /// the namespace, so it goes with them and nothing about it is
    /// persisted. Pins left by a crash are removed by [`Network::reconcile`].
    pub fn take_loopback_only(&self) -> Option<std::path::PathBuf> {
        self.loners().pop()
    }

    /// A run that took from a pool is up (or failed): drops the pin of a
    /// loopback-only namespace it took (`tier` None: a `none` run) and tops
    /// the pool up in the background (see [`crate::pools::top_up_soon`]).
    pub fn created(self: &Arc<Self>, tier: Option<Tier>, loner: Option<std::path::PathBuf>) {
        if let Some(p) = loner {
            self.unpin_soon(p);
        }
        let spare = match tier {
            Some(t) => self.pool().ready.get(&t).is_some_and(|v| !v.is_empty()),
            None => !self.loners().is_empty(),
        };
        let me = self.clone();
        crate::pools::top_up_soon(spare, move || match tier {
            Some(t) => me.refill_soon(t),
            None => me.refill_loopback_only_soon(),
        });
    }

    /// Drops a taken namespace's pin, in the background.
    fn unpin_soon(&self, path: std::path::PathBuf) {
        tokio::task::spawn_blocking(move || {
            if let Err(e) = sbx_netns::remove_pinned(&path) {
                tracing::error!(path = %path.display(), error = %e, "unpin network namespace");
            }
        });
    }

    /// Tops up the loopback-only namespaces in the background.
    fn refill_loopback_only_soon(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.refilling_loners.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            while !me.draining() && me.loners().len() < POOL_SIZE {
                let path = {
                    let mut pool = me.pool();
                    pool.counter += 1;
                    me.netns_dir
                        .join(format!("lo-{}-{}", std::process::id(), pool.counter))
                };
                let dir = me.netns_dir.clone();
                let p = path.clone();
                let made = tokio::task::spawn_blocking(move || {
                    std::fs::create_dir_all(&dir)
                        .map_err(|source| sbx_netns::NetnsError::Open { pid: 0, source })?;
                    sbx_netns::create_pinned_loopback_only(&p)
                })
                .await;
                match made {
                    Ok(Ok(())) if me.draining() => {
                        let _ =
                            tokio::task::spawn_blocking(move || sbx_netns::remove_pinned(&path))
                                .await;
                    }
                    Ok(Ok(())) => me.loners().push(path),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %format!("{:#}", anyhow::Error::from(e)), "refill loopback-only namespaces");
                        let _ =
                            tokio::task::spawn_blocking(move || sbx_netns::remove_pinned(&path))
                                .await;
                        break;
                    }
                    Err(_) => break,
                }
            }
            me.refilling_loners.store(false, Ordering::Release);
        });
    }
}
