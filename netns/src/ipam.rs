//! Address allocation for a bridge's subnet. Pure: the caller persists
//! nothing here; the set of addresses in use is rebuilt from the runs that
//! exist, so a crash can never leak an address.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpamError {
    #[error("{0:?} is not an IPv4 CIDR (a.b.c.d/len)")]
    BadCidr(String),
    #[error("subnet /{0} is too small (at most /28)")]
    TooSmall(u8),
    #[error("no free address left in {0}")]
    Exhausted(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subnet {
    pub network: Ipv4Addr,
    pub prefix: u8,
}

impl Subnet {
    pub fn parse(s: &str) -> Result<Subnet, IpamError> {
        let err = || IpamError::BadCidr(s.to_string());
        let (a, p) = s.split_once('/').ok_or_else(err)?;
        let addr: Ipv4Addr = a.parse().map_err(|_| err())?;
        let prefix: u8 = p.parse().map_err(|_| err())?;
        if prefix > 28 {
            return Err(IpamError::TooSmall(prefix));
        }
        let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
        Ok(Subnet {
            network: Ipv4Addr::from(u32::from(addr) & mask),
            prefix,
        })
    }

    fn size(&self) -> u32 {
        1u32 << (32 - u32::from(self.prefix))
    }

    /// The bridge's own address: the first host address.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1)
    }

    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + self.size() - 1)
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let n = u32::from(self.network);
        (n..n + self.size()).contains(&u32::from(ip))
    }

    /// Splits into two halves (the allowlist and open bridges' subnets).
    pub fn halves(&self) -> Result<(Subnet, Subnet), IpamError> {
        if self.prefix >= 28 {
            return Err(IpamError::TooSmall(self.prefix + 1));
        }
        let p = self.prefix + 1;
        let second = Ipv4Addr::from(u32::from(self.network) + (self.size() / 2));
        Ok((
            Subnet {
                network: self.network,
                prefix: p,
            },
            Subnet {
                network: second,
                prefix: p,
            },
        ))
    }
}

impl std::fmt::Display for Subnet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// The lowest free host address of `subnet`, not the network, gateway or
/// broadcast address and not in `used`.
pub fn allocate(subnet: Subnet, used: &BTreeSet<Ipv4Addr>) -> Result<Ipv4Addr, IpamError> {
    let first = u32::from(subnet.gateway()) + 1;
    let last = u32::from(subnet.broadcast());
    (first..last)
        .map(Ipv4Addr::from)
        .find(|ip| !used.contains(ip))
        .ok_or_else(|| IpamError::Exhausted(subnet.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_lowest_free_and_reuses_released() {
        let s = Subnet::parse("10.88.0.0/28").expect("subnet");
        assert_eq!(s.gateway(), Ipv4Addr::new(10, 88, 0, 1));
        let mut used = BTreeSet::new();
        let a = allocate(s, &used).expect("a");
        assert_eq!(a, Ipv4Addr::new(10, 88, 0, 2));
        used.insert(a);
        let b = allocate(s, &used).expect("b");
        assert_eq!(b, Ipv4Addr::new(10, 88, 0, 3));
        used.insert(b);
        used.remove(&a);
        assert_eq!(allocate(s, &used).expect("reuse"), a);
    }

    #[test]
    fn exhaustion_is_an_error_and_never_hands_out_broadcast() {
        let s = Subnet::parse("10.88.0.0/28").expect("subnet");
        let mut used = BTreeSet::new();
        for _ in 0..13 {
            let ip = allocate(s, &used).expect("ip");
            assert_ne!(ip, s.broadcast());
            used.insert(ip);
        }
        assert_eq!(
            allocate(s, &used),
            Err(IpamError::Exhausted("10.88.0.0/28".into()))
        );
    }

    #[test]
    fn parses_normalizes_and_splits() {
        let s = Subnet::parse("10.88.7.9/16").expect("subnet");
        assert_eq!(s.to_string(), "10.88.0.0/16");
        let (a, b) = s.halves().expect("halves");
        assert_eq!(
            (a.to_string(), b.to_string()),
            ("10.88.0.0/17".into(), "10.88.128.0/17".into())
        );
        assert!(
            b.contains(Ipv4Addr::new(10, 88, 200, 1)) && !a.contains(Ipv4Addr::new(10, 88, 200, 1))
        );
        assert!(matches!(
            Subnet::parse("10.0.0.0/30"),
            Err(IpamError::TooSmall(30))
        ));
        assert!(matches!(Subnet::parse("nope"), Err(IpamError::BadCidr(_))));
    }
}
