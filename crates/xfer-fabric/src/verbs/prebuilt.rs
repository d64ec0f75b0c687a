//! Connections built ahead of need. Creating a connection's CQs and QPs and moving them to INIT
//! (plus, on the responder, posting the marker receives) is most of `Peer.Connect`'s local work:
//! on rxe under TCG 2.3 ms of the initiator's 3.2 ms prepare phase and 2.7 ms of the responder's
//! 5.1 ms accept. None of it depends on the peer, so the verbs fabric keeps a few connections of
//! each recently used *shape* (QP count, depth, which CQs) built and in INIT, takes one when a
//! negotiation starts, and rebuilds the one it took on a thread of its own in `SCHED_IDLE`
//! (`VerbsFabric::refill`), so the rebuild takes no core the handshake wants. Whatever depends
//! on the peer (its PSN draw, RTR and RTS) still happens per connection.
//!
//! This module is the bookkeeping only, generic over the key and the item, so its rules are
//! tested without a device:
//! * at most `per_shape` items per shape and `max_shapes` shapes, the least recently used shape
//!   (and what it holds) dropped for a new one;
//! * at most `max_weight` in all (the weight is the QP count: a peer asking for 256-QP
//!   connections cannot make this agent hold hundreds of idle QPs);
//! * one refill at a time; it builds until every shape is full, and whether it is done is decided
//!   under the same lock a take records its demand under, so no demand is left unserved;
//! * a failed build ends the refill (the next take starts another), never the caller's connect.
use std::sync::Mutex;

/// The pool. `K` is the shape, `T` a built item.
pub struct Prebuilt<K, T> {
    state: Mutex<State<K, T>>,
    per_shape: usize,
    max_shapes: usize,
    max_weight: usize,
    weight: fn(&K) -> usize,
}

struct State<K, T> {
    shapes: Vec<Shape<K, T>>,
    refilling: bool,
    clock: u64,
}

struct Shape<K, T> {
    key: K,
    ready: Vec<T>,
    last_used: u64,
}

/// What [`Prebuilt::take`] found.
pub struct Taken<T> {
    /// A built item, if one of the shape was ready.
    pub item: Option<T>,
    /// True when the caller should start a refill ([`Prebuilt::refill`], off the runtime): none
    /// is running and some shape is short.
    pub refill: bool,
    /// Items dropped because their shape was evicted for this one (drop them off the lock).
    pub evicted: Vec<T>,
}

impl<K: Clone + PartialEq, T> Prebuilt<K, T> {
    /// A pool keeping `per_shape` items of each of at most `max_shapes` shapes, `max_weight` in
    /// all. `per_shape` 0 disables it: `take` always misses and never asks for a refill.
    pub fn new(per_shape: usize, max_shapes: usize, max_weight: usize, weight: fn(&K) -> usize) -> Self {
        Prebuilt {
            state: Mutex::new(State { shapes: Vec::new(), refilling: false, clock: 0 }),
            per_shape,
            max_shapes: max_shapes.max(1),
            max_weight,
            weight,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K, T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a ready item of shape `key` if there is one, and remembers `key` as wanted (a shape
    /// that could never fit in `max_weight` is not remembered).
    pub fn take(&self, key: &K) -> Taken<T> {
        if self.per_shape == 0 || (self.weight)(key) > self.max_weight {
            return Taken { item: None, refill: false, evicted: Vec::new() };
        }
        let mut st = self.lock();
        st.clock += 1;
        let now = st.clock;
        let mut evicted = Vec::new();
        let item = match st.shapes.iter_mut().find(|s| s.key == *key) {
            Some(s) => {
                s.last_used = now;
                s.ready.pop()
            }
            None => {
                if st.shapes.len() >= self.max_shapes {
                    if let Some(i) = st.shapes.iter().enumerate().min_by_key(|(_, s)| s.last_used).map(|(i, _)| i) {
                        evicted = st.shapes.swap_remove(i).ready;
                    }
                }
                st.shapes.push(Shape { key: key.clone(), ready: Vec::new(), last_used: now });
                None
            }
        };
        let refill = !st.refilling && self.wanted(&st).is_some();
        if refill {
            st.refilling = true;
        }
        Taken { item, refill, evicted }
    }

    /// The total weight of the items ready in `st`.
    fn weight_held(&self, st: &State<K, T>) -> usize {
        st.shapes.iter().map(|s| s.ready.len() * (self.weight)(&s.key)).sum()
    }

    /// The most recently used shape that is short of `per_shape` and whose next item fits in
    /// `max_weight`.
    fn wanted(&self, st: &State<K, T>) -> Option<K> {
        let held = self.weight_held(st);
        st.shapes
            .iter()
            .filter(|s| s.ready.len() < self.per_shape && held + (self.weight)(&s.key) <= self.max_weight)
            .max_by_key(|s| s.last_used)
            .map(|s| s.key.clone())
    }

    /// Builds until no shape is short, after [`Taken::refill`] said so. Runs on the caller's
    /// thread (the blocking pool: building is system calls). A build error ends the refill and
    /// is returned; the items built before it are kept.
    pub fn refill<E>(&self, mut build: impl FnMut(&K) -> Result<T, E>) -> Result<usize, E> {
        let mut built = 0;
        loop {
            let key = {
                let mut st = self.lock();
                match self.wanted(&st) {
                    Some(k) => k,
                    None => {
                        st.refilling = false;
                        return Ok(built);
                    }
                }
            };
            let item = match build(&key) {
                Ok(item) => item,
                Err(e) => {
                    self.lock().refilling = false;
                    return Err(e);
                }
            };
            // The shape may have been evicted, or filled by nobody else (refills are exclusive),
            // while it was built: then the item is dropped.
            let mut st = self.lock();
            let fits = self.weight_held(&st) + (self.weight)(&key) <= self.max_weight;
            match st.shapes.iter_mut().find(|s| s.key == key) {
                Some(s) if fits && s.ready.len() < self.per_shape => {
                    s.ready.push(item);
                    built += 1;
                }
                _ => {
                    drop(st);
                    drop(item);
                }
            }
        }
    }

    /// Items ready now, summed over shapes, and their total weight.
    pub fn held(&self) -> (usize, usize) {
        let st = self.lock();
        (st.shapes.iter().map(|s| s.ready.len()).sum(), self.weight_held(&st))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shape = (qps, tag); items record the shape they were built for.
    fn pool(per_shape: usize, max_shapes: usize, max_weight: usize) -> Prebuilt<(usize, u8), (usize, u8)> {
        Prebuilt::new(per_shape, max_shapes, max_weight, |k| k.0)
    }

    fn fill(p: &Prebuilt<(usize, u8), (usize, u8)>) -> usize {
        p.refill(|k| Ok::<_, ()>(*k)).unwrap()
    }

    #[test]
    fn a_miss_learns_the_shape_and_the_refill_serves_the_next_take() {
        let p = pool(2, 4, 64);
        let t = p.take(&(4, 0));
        assert!(t.item.is_none(), "nothing is built before a shape is first asked for");
        assert!(t.refill, "the first miss asks for a refill");
        assert_eq!(fill(&p), 2, "per_shape items built");
        assert_eq!(p.held(), (2, 8));
        let t = p.take(&(4, 0));
        assert_eq!(t.item, Some((4, 0)), "the built item, of the asked shape");
        assert!(t.refill, "a take leaves the shape short: refill again");
        assert_eq!(p.take(&(2, 0)).item, None, "another shape is not served by this one's items");
    }

    #[test]
    fn one_refill_at_a_time_and_no_demand_left_behind() {
        let p = pool(1, 4, 64);
        assert!(p.take(&(1, 0)).refill);
        // While that refill has not run, further takes do not start another.
        assert!(!p.take(&(1, 1)).refill);
        assert!(!p.take(&(1, 2)).refill);
        // The one refill serves every shape that was asked for meanwhile.
        assert_eq!(fill(&p), 3);
        for tag in 0..3 {
            assert_eq!(p.take(&(1, tag)).item, Some((1, tag)));
        }
    }

    #[test]
    fn weight_caps_what_is_held_and_oversized_shapes_are_never_kept() {
        let p = pool(4, 4, 10);
        let t = p.take(&(11, 0));
        assert!(t.item.is_none() && !t.refill, "a shape over max_weight is not learnt");
        assert!(p.take(&(4, 0)).refill);
        assert_eq!(fill(&p), 2, "two 4-QP items fit in 10, a third would not");
        assert_eq!(p.held(), (2, 8));
        // A lighter shape uses what is left.
        p.take(&(1, 0));
        assert_eq!(fill(&p), 2);
        assert_eq!(p.held(), (4, 10));
    }

    #[test]
    fn the_least_recently_used_shape_is_evicted_with_its_items() {
        let p = pool(1, 2, 64);
        p.take(&(1, 0));
        p.take(&(1, 1));
        fill(&p);
        assert_eq!(p.held().0, 2);
        // Touch shape 0 (takes its item), so shape 1 is the least recently used.
        assert_eq!(p.take(&(1, 0)).item, Some((1, 0)));
        let t = p.take(&(1, 2));
        assert_eq!(t.evicted, vec![(1, 1)], "shape 1 and its item go");
        assert!(t.item.is_none());
        fill(&p);
        assert_eq!(p.take(&(1, 1)).item, None, "an evicted shape is a miss");
    }

    #[test]
    fn a_failed_build_ends_the_refill_keeps_what_was_built_and_the_next_take_retries() {
        let p = pool(3, 4, 64);
        assert!(p.take(&(1, 0)).refill);
        let mut n = 0;
        let r = p.refill(|k| {
            n += 1;
            if n == 2 {
                Err("device busy")
            } else {
                Ok(*k)
            }
        });
        assert_eq!(r, Err("device busy"));
        assert_eq!(p.held().0, 1, "the item built before the failure is kept");
        let t = p.take(&(1, 0));
        assert_eq!(t.item, Some((1, 0)));
        assert!(t.refill, "the refill flag was cleared by the failure: the next take asks again");
    }

    #[test]
    fn per_shape_zero_disables_the_pool() {
        let p = pool(0, 4, 64);
        let t = p.take(&(1, 0));
        assert!(t.item.is_none() && !t.refill);
        assert_eq!(fill(&p), 0);
        assert_eq!(p.held(), (0, 0));
    }
}
