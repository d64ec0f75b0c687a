//! Per-identity shares of the agent's global limits: one tenant's use never makes another
//! tenant's first request fail.
//!
//! An agent is shared by every application on its node. Its global limits (transfers, channels,
//! `WatchInbound` subscriptions, regions, registered bytes) are first come, first served, so one
//! client holding all of a limit locks every other client out until it lets go. Each such limit
//! therefore also has a per-identity cap, `limits.tenant_share` of the global one (at least 1):
//! with the default 0.5, one identity can hold at most half, and another identity's first request
//! finds the other half free.
//!
//! A [`Tenant`] is who a share is keyed on: the role and name of the caller's certificate (or
//! `uid-N` on the local unix socket), never a field the caller sends. Plaintext callers (allowed
//! on loopback only, where every caller is trusted with every role) share no quota and are not
//! capped by shares: plaintext is the single-user mode.
//!
//! [`Quota`] counts units (one per object, or bytes) per tenant and hands out [`Permit`]s that
//! give them back when dropped, so whatever owns the permit (a region, a stream's state) frees
//! its share on every path by which it ends.
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use xfer_fabric::identity::{Caller, Role};

/// Who a share is charged to. `None` inside: exempt (plaintext mode).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Tenant(Option<String>);

impl Tenant {
    /// The tenant of an authenticated caller; plaintext callers are exempt.
    pub fn of(caller: &Caller) -> Tenant {
        match caller.role {
            Role::Plaintext => Tenant(None),
            role => Tenant(Some(format!("{role}/{}", caller.name))),
        }
    }

    /// A tenant that no share applies to (plaintext, the agent itself, restored state).
    pub fn exempt() -> Tenant {
        Tenant(None)
    }

    pub fn key(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_deref().unwrap_or("plaintext"))
    }
}

/// The per-identity cap of a global limit `max` under share `f`: at least 1, at most `max`.
pub fn share_of(max: u64, f: f64) -> u64 {
    if f >= 1.0 {
        return max;
    }
    // f is in (0, 1) (checked at load); the product of a u64 and a fraction below 1 fits.
    ((max as f64 * f).floor() as u64).clamp(1, max.max(1))
}

/// Refusal: `tenant` already holds its share of `what`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{tenant} holds {held} of its share of {what} ({cap} of {max}, limits.tenant_share); other identities keep the rest")]
pub struct ShareExceeded {
    pub what: &'static str,
    pub tenant: String,
    pub held: u64,
    pub cap: u64,
    pub max: u64,
}

/// Units held, by tenant key.
type Held = Arc<Mutex<HashMap<String, u64>>>;

/// Units held per tenant for one limit (the global count is the limit's own business). A clone
/// counts into the same map.
#[derive(Clone)]
pub struct Quota {
    what: &'static str,
    max: u64,
    cap: u64,
    held: Held,
}

/// Units of a [`Quota`] held by one tenant; given back on drop.
pub struct Permit {
    held: Option<(Held, String)>,
    n: u64,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit").field("tenant", &self.held.as_ref().map(|h| &h.1)).field("n", &self.n).finish()
    }
}

/// Several permits held together by one object (a region holds its count and its bytes).
#[derive(Debug, Default)]
pub struct Permits(pub Vec<Permit>);

impl Permits {
    /// The key of the tenant they are charged to (`None`: exempt).
    pub fn tenant(&self) -> Option<&str> {
        self.0.iter().find_map(|p| p.held.as_ref().map(|h| h.1.as_str()))
    }
}

impl Quota {
    /// `what` names the limit in refusals (`"transfers"`, `"registered bytes"`); `max` is the
    /// global limit and `share` the fraction of it one tenant may hold.
    pub fn new(what: &'static str, max: u64, share: f64) -> Quota {
        Quota { what, max, cap: share_of(max, share), held: Arc::new(Mutex::new(HashMap::new())) }
    }

    /// The per-tenant cap.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Takes `n` units for `tenant`, or refuses if that would pass its share. Exempt tenants
    /// always get a permit that counts nothing.
    pub fn take(&self, tenant: &Tenant, n: u64) -> Result<Permit, ShareExceeded> {
        let Some(key) = tenant.key() else { return Ok(Permit { held: None, n: 0 }) };
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let now = held.get(key).copied().unwrap_or(0);
        if now.saturating_add(n) > self.cap {
            return Err(ShareExceeded { what: self.what, tenant: key.to_string(), held: now, cap: self.cap, max: self.max });
        }
        *held.entry(key.to_string()).or_insert(0) += n;
        Ok(Permit { held: Some((self.held.clone(), key.to_string())), n })
    }

    /// Charges `n` units to the tenant keyed `key` whatever it holds already: for state that
    /// comes back (regions restored from the catalog) rather than being asked for. It counts
    /// from then on, so the tenant's next request sees it.
    pub fn charge(&self, key: &str, n: u64) -> Permit {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        *held.entry(key.to_string()).or_insert(0) += n;
        Permit { held: Some((self.held.clone(), key.to_string())), n }
    }

    /// Units `tenant` holds now.
    pub fn held(&self, tenant: &Tenant) -> u64 {
        tenant.key().map_or(0, |k| self.held.lock().unwrap_or_else(|p| p.into_inner()).get(k).copied().unwrap_or(0))
    }

    /// Tenants holding anything (an entry lives only while its tenant holds units).
    pub fn tenants(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some((held, key)) = self.held.take() else { return };
        let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = held.get_mut(&key) {
            *v = v.saturating_sub(self.n);
            if *v == 0 {
                held.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{share_of, Quota, Tenant};
    use xfer_fabric::identity::{Caller, Role};

    fn tenant(name: &str) -> Tenant {
        Tenant::of(&Caller { role: Role::Client, name: name.into() })
    }

    #[test]
    fn a_share_is_a_fraction_of_the_limit_and_never_zero() {
        assert_eq!(share_of(256, 0.5), 128);
        assert_eq!(share_of(1, 0.5), 1);
        assert_eq!(share_of(3, 0.25), 1);
        assert_eq!(share_of(u64::MAX, 0.5), u64::MAX / 2 + 1);
        assert_eq!(share_of(100, 1.0), 100);
    }

    #[test]
    fn one_tenant_at_its_share_leaves_the_rest_to_others_and_gets_it_back_on_drop() {
        let q = Quota::new("transfers", 4, 0.5);
        let (a, b) = (tenant("a"), tenant("b"));
        let p1 = q.take(&a, 1).unwrap();
        let p2 = q.take(&a, 1).unwrap();
        let e = q.take(&a, 1).unwrap_err();
        assert_eq!((e.held, e.cap), (2, 2));
        assert!(e.to_string().contains("client/a"), "{e}");
        let _b = q.take(&b, 2).unwrap();
        drop(p1);
        let _p3 = q.take(&a, 1).unwrap();
        drop(p2);
        drop(_p3);
        assert_eq!(q.held(&a), 0);
        assert_eq!(q.tenants(), 1, "a's entry is gone once it holds nothing");
    }

    #[test]
    fn plaintext_callers_are_exempt_and_count_nothing() {
        let q = Quota::new("regions", 2, 0.5);
        let t = Tenant::of(&Caller { role: Role::Plaintext, name: "loopback".into() });
        let permits: Vec<_> = (0..10).map(|_| q.take(&t, 1).unwrap()).collect();
        assert_eq!(q.tenants(), 0);
        drop(permits);
    }

    #[test]
    fn restored_state_is_charged_past_the_share_and_counts_from_then_on() {
        let q = Quota::new("regions", 4, 0.5);
        let a = tenant("a");
        let restored: Vec<_> = (0..3).map(|_| q.charge("client/a", 1)).collect();
        assert_eq!(q.held(&a), 3);
        assert!(q.take(&a, 1).is_err(), "over its share until some of it goes");
        let permits = super::Permits(restored);
        assert_eq!(permits.tenant(), Some("client/a"));
        drop(permits);
        assert_eq!(q.held(&a), 0);
        q.take(&a, 1).unwrap();
    }

    #[test]
    fn a_byte_count_past_the_share_is_refused_without_overflow() {
        let q = Quota::new("registered bytes", 1 << 30, 0.5);
        let a = tenant("a");
        let _p = q.take(&a, 1 << 29).unwrap();
        assert!(q.take(&a, u64::MAX).is_err());
        assert!(q.take(&a, 1).is_err());
        assert_eq!(q.held(&a), 1 << 29);
    }
}
