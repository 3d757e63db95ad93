//! The grouping engine's pure core: which items form the next group, and what a group's
//! answer or failure does to each of its items. No I/O; the clock is passed in.
//!
//! # Who pays for a failure
//!
//! A failure is charged to an item only when the item was alone in the call: a group's
//! failure cannot say which of its items caused it, so it is charged to none of them.
//!
//! - a **permanent** failure (a 4xx, a cost that never fits) of a group is **bisected**: each
//!   half is sent again at once, until the item that fails stands alone, and fails, with
//!   its reason; the others are answered;
//! - a **transient** failure sends the **same group** again with the same key, at most
//!   [`max_attempts`](GroupConfig::max_attempts) times in a row; then its items fail with
//!   the provider's reason (a failure of the provider, not of an item);
//! - a **malformed** answer, or an item's element missing, named twice or rejected, sends the
//!   items again as [`Resend`] says: by default regrouped with other items to send again,
//!   alone once such a group has failed them too;
//! - alone, each failed call counts toward the item's attempts, and it fails with its last
//!   reason after `max_attempts` (a permanent failure at once).
//!
//! An answer that no call of the grouper's produced (a [`Suppressed`](crate::idempotency::Suppressed)
//! response: a record replayed, or a call in flight joined) is read like any other, but
//! charges nothing: its rejected items are sent again with a new key, so an answer stored
//! before a restart and then rejected costs no attempt. An item's first
//! [`FREE_REPLAYS`] replays are free; past them, replays are charged like calls, so that a
//! layer below replaying whatever the key cannot loop an item.

use std::collections::VecDeque;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::attribute::{distribute, input_weights, output_weights};
use super::call::{CallResult, FormedGroup};
use super::config::{GroupConfig, Resend};
use super::item::GroupItem;
use super::outcome::{FailureKind, GroupStats, ItemFailure, ItemOutcome, ItemUsage};
use super::request::RequestShape;
use super::split::{Found, Split, split};
use super::template::Template;
use super::validate::Validator;
use crate::cost::Cost;
use crate::estimate::Estimator;
use crate::quota::Dimension;

/// Replayed answers an item may get free of charge: more than the rounds a run may have
/// stored for it before a restart (its first group, a regrouped one, up to ten halvings of a
/// group of 1,000, and its calls alone). Past them, a replay is charged like a call.
pub(crate) const FREE_REPLAYS: u32 = 16;

/// Tokens a chat message costs beyond its text (role, separators).
const MESSAGE_OVERHEAD: u64 = 4;

/// The largest estimated cost of a group, by dimension: set in the configuration
/// ([`max_cost`](GroupConfig::max_cost), on the total), and learnt from a budget that refused
/// a group as too large.
#[derive(Debug, Clone, Copy, Default)]
struct Caps {
    total: Option<u64>,
    input: Option<u64>,
    output: Option<u64>,
}

impl Caps {
    fn exceeded_by(&self, input: u64, output: u64) -> bool {
        let over = |cap: Option<u64>, cost: u64| cap.is_some_and(|cap| cost > cap);
        over(self.total, input + output) || over(self.input, input) || over(self.output, output)
    }

    /// Caps `dimension` at `capacity`; whether that tightened a cap.
    fn learn(&mut self, dimension: Dimension, capacity: u64) -> bool {
        let cap = match dimension {
            Dimension::InputTokens => &mut self.input,
            Dimension::OutputTokens => &mut self.output,
            // A group is one request: never too many of them.
            Dimension::Requests => return false,
            _ => &mut self.total,
        };
        let tighter = cap.is_none_or(|cap| capacity < cap);
        *cap = Some(cap.map_or(capacity, |cap| cap.min(capacity)));
        tighter
    }
}

#[derive(Debug)]
struct Slot {
    item: GroupItem,
    key: String,
    rendered: String,
    input: u64,
    output: u64,
    seq: u64,
    /// When it entered its queue (the fresh queue, or the queue of items to send again).
    queued_at: Instant,
    /// Calls it took part in (answers replayed without a call aside).
    attempts: u32,
    /// Failed calls it was alone in.
    charged: u32,
    /// Answers replayed for it without a call.
    replays: u32,
    /// Bumped whenever the item is regrouped: part of its groups' keys.
    round: u32,
    /// The largest group it may join now.
    size_limit: usize,
    /// Waits to be sent again (grouped only with other items to send again).
    again: bool,
    /// Has waited to be sent again before: with [`Resend::Regroup`], a bad answer now sends
    /// it alone.
    regrouped: bool,
    resent: bool,
    resent_alone: bool,
    usage: ItemUsage,
}

/// The planner: items by class (fresh ones, and those to send again, each in arrival
/// order), groups to send again as they are, and what has finished.
pub(crate) struct Planner<T> {
    config: GroupConfig,
    template: Arc<dyn Template>,
    instructions: Arc<str>,
    shape: Arc<RequestShape>,
    shared_input: u64,
    caps: Caps,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    fresh: [VecDeque<usize>; 3],
    again: [VecDeque<usize>; 3],
    /// Groups sent again as they are (after a transient failure), and halves of a group
    /// that failed permanently: sent before anything else.
    resend: VecDeque<FormedGroup>,
    in_flight: usize,
    next_seq: u64,
    /// Pending items with a deadline: none, and the expiry scan is skipped.
    dated: usize,
    finished: Vec<(usize, ItemOutcome<T>)>,
    pub(crate) stats: GroupStats,
}

impl<T> std::fmt::Debug for Planner<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planner")
            .field("pending", &self.pending())
            .field("in_flight", &self.in_flight)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T> Planner<T> {
    pub(crate) fn new(
        config: GroupConfig,
        template: Arc<dyn Template>,
        instructions: Arc<str>,
        shape: Arc<RequestShape>,
        estimator: &dyn Estimator,
    ) -> Self {
        let shared = template.render(&instructions, &[], &[]);
        let shared_input =
            2 * MESSAGE_OVERHEAD + estimator.count(&shared.system) + estimator.count(&shared.user);
        let caps = Caps {
            total: config.max_cost,
            ..Caps::default()
        };
        Self {
            config,
            template,
            instructions,
            shape,
            shared_input,
            caps,
            slots: Vec::new(),
            free: Vec::new(),
            fresh: Default::default(),
            again: Default::default(),
            resend: VecDeque::new(),
            in_flight: 0,
            next_seq: 0,
            dated: 0,
            finished: Vec::new(),
            stats: GroupStats::default(),
        }
    }

    /// Adds an item; returns its slot (which names it in [`take_finished`](Self::take_finished)).
    pub(crate) fn push(
        &mut self,
        item: GroupItem,
        estimator: &dyn Estimator,
        now: Instant,
    ) -> usize {
        let rendered = self.template.render_item(&item);
        let slot = Slot {
            input: estimator.count(&rendered),
            output: item
                .output()
                .unwrap_or(self.config.item_output)
                .saturating_add(self.config.answer_overhead),
            key: item.idempotency_key(),
            rendered,
            seq: self.next_seq,
            queued_at: now,
            attempts: 0,
            charged: 0,
            replays: 0,
            round: 0,
            size_limit: self.config.max_items.get(),
            again: false,
            regrouped: false,
            resent: false,
            resent_alone: false,
            usage: ItemUsage::default(),
            item,
        };
        self.next_seq += 1;
        self.dated += usize::from(slot.item.due().is_some());
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index] = Some(slot);
                index
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        self.enqueue(index);
        index
    }

    /// Groups in flight at most.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.config.max_in_flight.get()
    }

    /// Items not finished yet (queued or in a group in flight).
    pub(crate) fn pending(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Outcomes since the last call, with their slots.
    pub(crate) fn take_finished(&mut self) -> Vec<(usize, ItemOutcome<T>)> {
        std::mem::take(&mut self.finished)
    }

    /// When a group that is not full may go without more items: the oldest fresh item's
    /// linger, or the oldest item to send again's [regroup wait](GroupConfig::regroup_wait)
    /// (only while a call in flight may still add to its group).
    pub(crate) fn linger_until(&self) -> Option<Instant> {
        let fresh = self.fresh.iter().filter_map(|queue| queue.front());
        let fresh = fresh.map(|&i| self.slot(i).queued_at + self.config.linger);
        let again = self
            .again
            .iter()
            .flatten()
            .filter(|_| self.in_flight > 0)
            .map(|&i| self.slot(i).queued_at + self.config.regroup_wait);
        fresh.chain(again).min()
    }

    /// The next group to send: a group to send again as it is first, then, by class, items
    /// to send again (once their group is full, nothing in flight can add to it, or they have
    /// waited the regroup wait), then fresh items in arrival order (once their group is full,
    /// or `flush`, or its oldest item has lingered). Items whose deadline has passed finish
    /// here, unsent.
    pub(crate) fn form(&mut self, now: Instant, flush: bool) -> Option<FormedGroup> {
        while let Some(group) = self.resend.pop_front() {
            let expired = group.members.iter().any(|&i| self.is_expired(i, now));
            if !expired {
                self.in_flight += 1;
                return Some(group);
            }
            // No longer the same group: the others are regrouped.
            for &i in &group.members {
                self.send_again(i, self.config.max_items.get(), now);
            }
        }
        for class in 0..self.fresh.len() {
            self.drop_expired(class, now);
            if !self.again[class].is_empty() {
                let (members, closed) = self.candidates(&self.again[class]);
                let waited = (self.again[class].iter())
                    .map(|&i| self.slot(i).queued_at)
                    .min()
                    .is_some_and(|at| at + self.config.regroup_wait <= now);
                if closed || waited || self.in_flight == 0 {
                    self.again[class].drain(..members.len());
                    return Some(self.launch(members));
                }
            }
            let Some(&front) = self.fresh[class].front() else {
                continue;
            };
            let (members, closed) = self.candidates(&self.fresh[class]);
            let lingered = self.slot(front).queued_at + self.config.linger <= now;
            if closed || flush || lingered {
                // The members are the front of the queue, in order.
                self.fresh[class].drain(..members.len());
                return Some(self.launch(members));
            }
        }
        None
    }

    fn launch(&mut self, members: Vec<usize>) -> FormedGroup {
        self.in_flight += 1;
        self.build(members)
    }

    /// The items of `queue` that would form a group now, and whether it is closed (full, or
    /// the next item would not fit).
    fn candidates(&self, queue: &VecDeque<usize>) -> (Vec<usize>, bool) {
        let mut members: Vec<usize> = Vec::new();
        let (mut input, mut output) = (self.shared_input, 0u64);
        let mut cap = usize::MAX;
        for &i in queue {
            let slot = self.slot(i);
            let limit = cap.min(slot.size_limit);
            if !members.is_empty() {
                let over = (self.caps).exceeded_by(input + slot.input, output + slot.output);
                if members.len() + 1 > limit || over {
                    return (members, true);
                }
            }
            cap = limit;
            input += slot.input;
            output += slot.output;
            members.push(i);
            if members.len() >= cap {
                return (members, true);
            }
        }
        (members, false)
    }

    fn build(&self, members: Vec<usize>) -> FormedGroup {
        let slots: Vec<&Slot> = members.iter().map(|&i| self.slot(i)).collect();
        let rendered: Vec<String> = slots.iter().map(|s| s.rendered.clone()).collect();
        let ids: Vec<&str> = slots.iter().map(|s| s.item.id()).collect();
        let prompt = self.template.render(&self.instructions, &rendered, &ids);
        let input = slots.iter().map(|s| s.input).sum::<u64>() + self.shared_input;
        let output = slots.iter().map(|s| s.output).sum::<u64>().max(1);
        let body = self.shape.body(&prompt, output);
        let keys: Vec<(&str, u32)> = slots.iter().map(|s| (s.key.as_str(), s.round)).collect();
        FormedGroup {
            priority: slots[0].item.class(),
            deadline: slots.iter().filter_map(|s| s.item.due()).min(),
            cost: Cost::new(input, output),
            key: group_key(self.shape.uri.path(), &body, &keys),
            body,
            transient: 0,
            members,
        }
    }

    /// Settles a group's call: attributes its usage, finishes items with a valid answer, and
    /// sends the others again (or fails them, as the [module docs](self) say).
    pub(crate) fn settle<V>(
        &mut self,
        group: FormedGroup,
        result: CallResult,
        validator: &V,
        now: Instant,
    ) where
        V: Validator<Output = T> + ?Sized,
    {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.stats.calls += 1;
        match result {
            CallResult::Answered { replayed: true, .. } => {
                self.stats.replayed_calls += 1;
                for &i in &group.members {
                    self.slot_mut(i).replays += 1;
                }
            }
            // Refused before it was sent.
            CallResult::TooLarge { .. } => {}
            _ => {
                for &i in &group.members {
                    self.slot_mut(i).attempts += 1;
                }
            }
        }
        match result {
            CallResult::Failed {
                transient,
                reason,
                usage,
            } => {
                if let Some((input, output)) = usage {
                    self.attribute(&group, input, output, None);
                }
                let reason = format!("the call failed: {reason}");
                if transient {
                    self.failed_transiently(group, reason);
                } else {
                    self.failed_permanently(group, reason, now);
                }
            }
            CallResult::TooLarge {
                dimension,
                capacity,
                reason,
            } => self.too_large(group, (dimension, capacity), reason, now),
            CallResult::Answered {
                text,
                usage,
                replayed,
            } => {
                if !replayed {
                    self.stats.answered_calls += 1;
                }
                let ids: Vec<&str> = group
                    .members
                    .iter()
                    .map(|&i| self.slot(i).item.id())
                    .collect();
                let split = split(&text, &ids);
                let lengths = match &split {
                    Split::Items { found, .. } => Some(
                        found
                            .iter()
                            .map(|f| match f {
                                Found::Answered(_, len) => *len,
                                _ => 0,
                            })
                            .collect::<Vec<_>>(),
                    ),
                    Split::Malformed(_) => None,
                };
                // A replayed answer was paid for by the call that stored it.
                if let Some((input, output)) = usage.filter(|_| !replayed) {
                    let weights = lengths.map(|l| output_weights(text.len(), &l));
                    self.attribute(&group, input, output, weights);
                }
                self.answered(group, split, validator, replayed, now);
            }
        }
    }

    fn answered<V>(
        &mut self,
        group: FormedGroup,
        split: Split,
        validator: &V,
        replayed: bool,
        now: Instant,
    ) where
        V: Validator<Output = T> + ?Sized,
    {
        let size = group.members.len();
        let verdicts: Vec<(usize, Result<T, String>)> = match split {
            Split::Malformed(why) => {
                self.stats.malformed_answers += 1;
                let why = format!("the answer was malformed: {why}");
                group
                    .members
                    .iter()
                    .map(|&i| (i, Err(why.clone())))
                    .collect()
            }
            Split::Items { found, unknown } => {
                self.stats.unknown_answers += unknown as u64;
                group
                    .members
                    .iter()
                    .zip(found)
                    .map(|(&i, found)| {
                        let verdict = match found {
                            Found::Answered(value, _) => validator
                                .validate(&self.slot(i).item, &value)
                                .map_err(|why| format!("the answer was rejected: {why}")),
                            Found::Missing => Err(String::from("the answer left the item out")),
                            Found::Duplicated => {
                                Err(String::from("the answer named the item twice"))
                            }
                        };
                        (i, verdict)
                    })
                    .collect()
            }
        };
        for (i, verdict) in verdicts {
            match verdict {
                Ok(output) => self.finish(i, Ok(output)),
                Err(why) => self.bad_answer(i, size, why, replayed, now),
            }
        }
    }

    /// The same group again, with its key: an ambiguous failure is not billed twice. After
    /// `max_attempts` transient failures in a row, its items fail with the provider's reason.
    fn failed_transiently(&mut self, mut group: FormedGroup, reason: String) {
        group.transient += 1;
        if group.transient >= self.config.max_attempts.get() {
            for &i in &group.members {
                self.fail(i, FailureKind::Call, reason.clone());
            }
            return;
        }
        for &i in &group.members {
            self.slot_mut(i).resent = true;
        }
        self.resend.push_back(group);
    }

    /// The budget can never admit the group: its capacity becomes a cap of the groups formed
    /// from now on, and the members go back to their queues, charged nothing (nothing was
    /// sent). Alone, the item fails: it can never be admitted.
    fn too_large(
        &mut self,
        group: FormedGroup,
        (dimension, capacity): (Dimension, u64),
        reason: String,
        now: Instant,
    ) {
        let reason = format!("the call failed: {reason}");
        if let [alone] = group.members[..] {
            self.fail(alone, FailureKind::Call, reason);
        } else if self.caps.learn(dimension, capacity) {
            for &i in &group.members {
                self.enqueue(i);
            }
        } else {
            // Nothing learnt (a cap of another kind than the grouper's): bisected, as any
            // permanent failure.
            self.failed_permanently(group, reason, now);
        }
    }

    /// Alone, the item fails now; a group is bisected, each half sent again at once with new
    /// keys, until the item that fails stands alone.
    fn failed_permanently(&mut self, group: FormedGroup, reason: String, now: Instant) {
        if let [alone] = group.members[..] {
            self.slot_mut(alone).charged += 1;
            self.fail(alone, FailureKind::Call, reason);
            return;
        }
        let expired: Vec<usize> = (group.members.iter().copied())
            .filter(|&i| self.is_expired(i, now))
            .collect();
        for &i in &expired {
            let why = String::from("the item's deadline passed before it could be sent again");
            self.fail(i, FailureKind::Deadline, why);
        }
        let members: Vec<usize> = (group.members.into_iter())
            .filter(|i| !expired.contains(i))
            .collect();
        let half = members.len().div_ceil(2);
        for part in [&members[..half], &members[half..]] {
            if part.is_empty() {
                continue;
            }
            for &i in part {
                let slot = self.slot_mut(i);
                slot.round += 1;
                slot.resent = true;
                slot.resent_alone |= part.len() == 1;
            }
            let half = self.build(part.to_vec());
            self.resend.push_back(half);
        }
    }

    /// A bad answer for the item (its element, or its group's whole answer). Alone, it counts
    /// toward its attempts (unless replayed, within [`FREE_REPLAYS`]); in a group, it is nobody's fault yet: the item
    /// goes again as [`Resend`] says.
    fn bad_answer(
        &mut self,
        i: usize,
        group_size: usize,
        why: String,
        replayed: bool,
        now: Instant,
    ) {
        if group_size == 1 {
            let slot = self.slot_mut(i);
            if !replayed || slot.replays > FREE_REPLAYS {
                slot.charged += 1;
            }
            if self.slot(i).charged >= self.config.max_attempts.get() {
                self.fail(i, FailureKind::Rejected, why);
            } else {
                self.send_again(i, 1, now);
            }
            return;
        }
        let limit = match self.config.resend {
            Resend::Regroup if self.slot(i).regrouped => 1,
            Resend::Regroup => self.config.max_items.get(),
            Resend::Smaller => (group_size / 2).max(1),
            Resend::Alone => 1,
        };
        self.send_again(i, limit, now);
    }

    /// Into the queue of items to send again, in arrival order, with a new round (so a new
    /// group key), in groups of at most `size_limit`.
    fn send_again(&mut self, i: usize, size_limit: usize, now: Instant) {
        let slot = self.slot_mut(i);
        slot.round += 1;
        slot.size_limit = size_limit;
        slot.again = true;
        slot.regrouped = true;
        slot.queued_at = now;
        slot.resent = true;
        slot.resent_alone |= size_limit == 1;
        self.enqueue(i);
    }

    fn enqueue(&mut self, i: usize) {
        let slot = self.slot(i);
        let (seq, class) = (slot.seq, slot.item.class().index());
        let queue = if slot.again {
            &mut self.again[class]
        } else {
            &mut self.fresh[class]
        };
        let slots = &self.slots;
        let seq_of = |j: usize| slots[j].as_ref().expect("a queued item has a slot").seq;
        let at = queue.partition_point(|&j| seq_of(j) < seq);
        queue.insert(at, i);
    }

    fn attribute(&mut self, group: &FormedGroup, input: u64, output: u64, out: Option<Vec<u64>>) {
        self.stats.input_tokens = self.stats.input_tokens.saturating_add(input);
        self.stats.output_tokens = self.stats.output_tokens.saturating_add(output);
        let own: Vec<u64> = group.members.iter().map(|&i| self.slot(i).input).collect();
        let inputs = distribute(input, &input_weights(self.shared_input, &own));
        // No answer to weigh by: zero weights split the output evenly.
        let weights = out.unwrap_or_else(|| vec![0; group.members.len()]);
        let outputs = distribute(output, &weights);
        for (n, &i) in group.members.iter().enumerate() {
            self.slot_mut(i).usage.add(inputs[n], outputs[n]);
        }
    }

    fn is_expired(&self, i: usize, now: Instant) -> bool {
        self.slot(i).item.due().is_some_and(|d| d.instant() <= now)
    }

    fn drop_expired(&mut self, class: usize, now: Instant) {
        if self.dated == 0 {
            return;
        }
        let expired: Vec<usize> = (self.fresh[class].iter().chain(&self.again[class]))
            .copied()
            .filter(|&i| self.is_expired(i, now))
            .collect();
        if expired.is_empty() {
            return;
        }
        self.fresh[class].retain(|i| !expired.contains(i));
        self.again[class].retain(|i| !expired.contains(i));
        for i in expired {
            let reason = String::from("the item's deadline passed before it could be sent");
            self.fail(i, FailureKind::Deadline, reason);
        }
    }

    fn fail(&mut self, i: usize, kind: FailureKind, reason: String) {
        self.stats.items_failed += 1;
        self.finish(i, Err(ItemFailure { kind, reason }));
    }

    fn finish(&mut self, i: usize, result: Result<T, ItemFailure>) {
        let slot = self.slots[i].take().expect("a finished item has a slot");
        self.free.push(i);
        self.dated -= usize::from(slot.item.due().is_some());
        self.stats.items_resent += u64::from(slot.resent);
        self.stats.items_resent_alone += u64::from(slot.resent_alone);
        self.finished.push((
            i,
            ItemOutcome {
                id: slot.item.id().to_owned(),
                result,
                attempts: slot.attempts,
                resent: slot.resent,
                resent_alone: slot.resent_alone,
                usage: slot.usage,
            },
        ));
    }

    fn slot(&self, i: usize) -> &Slot {
        self.slots[i].as_ref().expect("a pending item has a slot")
    }

    fn slot_mut(&mut self, i: usize) -> &mut Slot {
        self.slots[i].as_mut().expect("a pending item has a slot")
    }
}

/// `group-` and 32 hex digits of SHA-256 over the request's path and body (everything the
/// model sees, and its parameters) and its members' keys and rounds, in order.
fn group_key(path: &str, body: &[u8], members: &[(&str, u32)]) -> String {
    let mut hash = Sha256::new();
    hash.update(b"tower-llm-quota group key 2\0");
    for part in [path.as_bytes(), body] {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    for (key, round) in members {
        hash.update((key.len() as u64).to_le_bytes());
        hash.update(key.as_bytes());
        hash.update(round.to_le_bytes());
    }
    super::item::hex_key("group-", &hash.finalize())
}

#[cfg(test)]
mod tests {
    //! The planner against a deliberately simple model: items in a plain list scanned
    //! linearly. After every settlement, the next group must be the one the model names
    //! (groups sent again first, then the best class: items to send again, then fresh ones,
    //! the prefix that fits), every item must end exactly once, as the model says (answered,
    //! rejected or failed), and usage adds up.

    use super::*;
    use crate::estimate::CharEstimator;
    use crate::group::{AnswerField, ApiFormat, TextTemplate};
    use crate::priority::Priority;
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::HashMap;

    fn shape() -> Arc<RequestShape> {
        Arc::new(RequestShape {
            format: ApiFormat::OpenAiChat,
            model: String::from("m"),
            uri: http::Uri::from_static("/v1/chat/completions"),
            headers: http::HeaderMap::new(),
        })
    }

    /// What the model keeps of an item.
    #[derive(Debug, Clone)]
    struct Modelled {
        class: usize,
        seq: u64,
        input: u64,
        output: u64,
        size_limit: usize,
        again: bool,
        regrouped: bool,
        charged: u32,
        replays: u32,
        queued: bool,
        ended: Option<&'static str>,
    }

    struct Model {
        items: Vec<Modelled>,
        resend: VecDeque<(Vec<usize>, u32)>,
        shared: u64,
        max_items: usize,
        max_cost: Option<u64>,
        max_attempts: u32,
        policy: Resend,
    }

    impl Model {
        /// The next group, and its transient failures so far.
        fn next(&mut self) -> Option<(Vec<usize>, u32)> {
            if let Some(group) = self.resend.pop_front() {
                return Some(group);
            }
            let class = (self.items.iter())
                .filter(|m| m.queued)
                .map(|m| m.class)
                .min()?;
            for again in [true, false] {
                let mut queued: Vec<usize> = (0..self.items.len())
                    .filter(|&i| {
                        let m = &self.items[i];
                        m.queued && m.class == class && m.again == again
                    })
                    .collect();
                queued.sort_by_key(|&i| self.items[i].seq);
                let mut members = Vec::new();
                let (mut cost, mut cap) = (self.shared, self.max_items);
                for i in queued {
                    let m = &self.items[i];
                    let limit = cap.min(m.size_limit);
                    let next = cost + m.input + m.output;
                    if !members.is_empty()
                        && (members.len() + 1 > limit || self.max_cost.is_some_and(|c| next > c))
                    {
                        break;
                    }
                    (cap, cost) = (limit, next);
                    members.push(i);
                    if members.len() >= cap {
                        break;
                    }
                }
                if !members.is_empty() {
                    for &i in &members {
                        self.items[i].queued = false;
                    }
                    return Some((members, 0));
                }
            }
            None
        }

        fn again(&mut self, i: usize, limit: usize) {
            let m = &mut self.items[i];
            (m.size_limit, m.again, m.regrouped, m.queued) = (limit, true, true, true);
        }

        fn settle(&mut self, members: &[usize], transient: u32, answer: &Answer) {
            let n = members.len();
            match answer {
                Answer::Transient if transient + 1 >= self.max_attempts => {
                    for &i in members {
                        self.items[i].ended = Some("call");
                    }
                }
                Answer::Transient => self.resend.push_back((members.to_vec(), transient + 1)),
                Answer::Permanent if n == 1 => self.items[members[0]].ended = Some("call"),
                Answer::Permanent => {
                    let half = n.div_ceil(2);
                    self.resend.push_back((members[..half].to_vec(), 0));
                    self.resend.push_back((members[half..].to_vec(), 0));
                }
                Answer::Drop(..) | Answer::Malformed => {
                    for &i in members {
                        self.items[i].replays += u32::from(answer.replayed());
                    }
                    for (k, &i) in members.iter().enumerate() {
                        if !answer.rejects(k) {
                            self.items[i].ended = Some("ok");
                        } else if n == 1 {
                            let free = answer.replayed() && self.items[i].replays <= FREE_REPLAYS;
                            self.items[i].charged += u32::from(!free);
                            if self.items[i].charged >= self.max_attempts {
                                self.items[i].ended = Some("rejected");
                            } else {
                                self.again(i, 1);
                            }
                        } else {
                            let limit = match self.policy {
                                Resend::Regroup if self.items[i].regrouped => 1,
                                Resend::Regroup => self.max_items,
                                Resend::Smaller => (n / 2).max(1),
                                Resend::Alone => 1,
                            };
                            self.again(i, limit);
                        }
                    }
                }
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Answer {
        /// Answer every member but those whose bit is set; replayed or not.
        Drop(u16, bool),
        Malformed,
        Transient,
        Permanent,
    }

    impl Answer {
        fn rejects(&self, k: usize) -> bool {
            match self {
                Answer::Drop(bits, _) => bits & (1 << (k % 16)) != 0,
                _ => true,
            }
        }

        fn replayed(&self) -> bool {
            matches!(self, Answer::Drop(_, true))
        }
    }

    fn answer() -> impl Strategy<Value = Answer> {
        prop_oneof![
            4 => (any::<u16>(), proptest::bool::weighted(0.2)).prop_map(|(b, r)| Answer::Drop(b, r)),
            1 => Just(Answer::Malformed),
            1 => Just(Answer::Transient),
            1 => Just(Answer::Permanent),
        ]
    }

    fn policy() -> impl Strategy<Value = Resend> {
        prop_oneof![
            Just(Resend::Regroup),
            Just(Resend::Alone),
            Just(Resend::Smaller)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn the_planner_forms_the_groups_the_model_names_and_ends_every_item_as_it_says(
            items in proptest::collection::vec((0..3usize, 1..400usize), 1..40),
            max_items in 1..12usize,
            max_attempts in 1..4u32,
            cap in proptest::option::of(200..3_000u64),
            policy in policy(),
            answers in proptest::collection::vec(answer(), 1..200),
        ) {
            let config = GroupConfig::new()
                .max_items(max_items).unwrap()
                .max_attempts(std::num::NonZeroU32::new(max_attempts).unwrap())
                .resend(policy);
            let config = match cap {
                Some(cap) => config.max_cost(std::num::NonZeroU64::new(cap).unwrap()),
                None => config,
            };
            let estimator = CharEstimator::new();
            let mut planner: Planner<serde_json::Value> = Planner::new(
                config.clone(),
                Arc::new(TextTemplate::default()),
                Arc::from("Shared instructions."),
                shape(),
                &estimator,
            );
            let now = Instant::now();
            let mut model = Model {
                items: Vec::new(),
                resend: VecDeque::new(),
                shared: planner.shared_input,
                max_items,
                max_cost: config.max_cost,
                max_attempts,
                policy,
            };
            for (n, &(class, chars)) in items.iter().enumerate() {
                let class = Priority::ALL[class];
                let item = GroupItem::new(format!("i{n}"), "x".repeat(chars)).priority(class);
                let slot = planner.push(item, &estimator, now);
                prop_assert_eq!(slot, n);
                let s = planner.slot(slot);
                model.items.push(Modelled {
                    class: class.index(), seq: s.seq, input: s.input, output: s.output,
                    size_limit: max_items, again: false, regrouped: false, charged: 0,
                    replays: 0, queued: true, ended: None,
                });
            }
            let mut ended: HashMap<usize, &'static str> = HashMap::new();
            let mut keys: HashMap<Vec<usize>, String> = HashMap::new();
            let mut attributed = (0u64, 0u64);
            let mut reported = (0u64, 0u64);
            let mut answers = answers.into_iter().cycle();
            for _ in 0..3_000 {
                let Some(group) = planner.form(now, true) else { break };
                let (expected, transient) = model.next().expect("the model has a group too");
                prop_assert_eq!(&group.members, &expected);
                let classes: std::collections::HashSet<usize> =
                    group.members.iter().map(|&i| planner.slot(i).item.class().index()).collect();
                prop_assert_eq!(classes.len(), 1);
                // The same group sent again keeps its key; a regrouped one never reuses one.
                match keys.get(&group.members) {
                    Some(key) if transient > 0 => prop_assert_eq!(key, &group.key),
                    _ => prop_assert!(!keys.values().any(|k| *k == group.key)),
                }
                keys.insert(group.members.clone(), group.key.clone());
                let ids: Vec<String> =
                    group.members.iter().map(|&i| planner.slot(i).item.id().to_owned()).collect();
                let (input, output) = (100 + ids.len() as u64, 7 * ids.len() as u64);
                let usage = Some((input, output));
                let answer = answers.next().unwrap();
                let result = match &answer {
                    Answer::Drop(_, replayed) => {
                        let kept: Vec<_> = ids.iter().enumerate()
                            .filter(|(k, _)| !answer.rejects(*k))
                            .map(|(_, id)| json!({"id": id, "answer": "ok"}))
                            .collect();
                        if !replayed {
                            reported = (reported.0 + input, reported.1 + output);
                        }
                        let text = serde_json::Value::Array(kept).to_string();
                        CallResult::Answered { text, usage, replayed: *replayed }
                    }
                    Answer::Malformed => {
                        reported = (reported.0 + input, reported.1 + output);
                        CallResult::Answered { text: "[{".into(), usage, replayed: false }
                    }
                    Answer::Transient => CallResult::Failed { transient: true, reason: "503".into(), usage: None },
                    Answer::Permanent => CallResult::Failed { transient: false, reason: "400".into(), usage: None },
                };
                let members = group.members.clone();
                model.settle(&members, transient, &answer);
                planner.settle(group, result, &AnswerField, now);
                for (slot, outcome) in planner.take_finished() {
                    attributed.0 += outcome.usage.input_tokens;
                    attributed.1 += outcome.usage.output_tokens;
                    let kind = match &outcome.result {
                        Ok(_) => "ok",
                        Err(e) if e.is_rejected() => "rejected",
                        Err(e) if e.is_call_failed() => "call",
                        Err(_) => "other",
                    };
                    prop_assert_eq!(Some(kind), model.items[slot].ended, "item {}", slot);
                    prop_assert!(ended.insert(slot, kind).is_none(), "ended twice");
                }
                for &i in &members {
                    prop_assert_eq!(model.items[i].ended.is_some(), ended.contains_key(&i));
                }
            }
            // Every item ended exactly once, and the usage of the calls made adds up.
            prop_assert_eq!(ended.len(), items.len());
            prop_assert_eq!(planner.pending(), 0);
            prop_assert_eq!((planner.stats.input_tokens, planner.stats.output_tokens), reported);
            prop_assert_eq!(attributed, reported);
        }
    }

    #[test]
    fn the_model_sees_a_planted_violation() {
        // The model's own group for a batch of three differs from a planner that would
        // put the second item first: the check above would fail.
        let mut model = Model {
            items: (0..3)
                .map(|seq| Modelled {
                    class: 2,
                    seq,
                    input: 1,
                    output: 1,
                    size_limit: 10,
                    again: false,
                    regrouped: false,
                    charged: 0,
                    replays: 0,
                    queued: true,
                    ended: None,
                })
                .collect(),
            resend: VecDeque::new(),
            shared: 0,
            max_items: 2,
            max_cost: None,
            max_attempts: 3,
            policy: Resend::Regroup,
        };
        assert_eq!(model.next(), Some((vec![0, 1], 0)));
        assert_ne!(model.next(), Some((vec![1, 2], 0)));
        // A permanent failure of a pair is bisected, not charged.
        model.settle(&[0, 1], 0, &Answer::Permanent);
        assert_eq!(model.next(), Some((vec![0], 0)));
        model.settle(&[0], 0, &Answer::Permanent);
        assert_eq!(model.items[0].ended, Some("call"));
        assert_eq!(model.items[1].ended, None);
    }

    #[test]
    fn a_group_too_large_for_the_budget_teaches_its_capacity() {
        let estimator = CharEstimator::new();
        let mut planner: Planner<serde_json::Value> = Planner::new(
            GroupConfig::new(),
            Arc::new(TextTemplate::default()),
            Arc::from("Shared."),
            shape(),
            &estimator,
        );
        let now = Instant::now();
        for n in 0..4 {
            planner.push(
                GroupItem::new(format!("i{n}"), "x".repeat(400)),
                &estimator,
                now,
            );
        }
        let four = planner.form(now, true).unwrap();
        assert_eq!(four.members.len(), 4);
        // The budget holds a bit more than two items' group at most.
        let two = planner.build(vec![0, 1]).cost.total_tokens();
        let refusal = |dimension| CallResult::TooLarge {
            dimension,
            capacity: two + 1,
            reason: String::from("too large"),
        };
        planner.settle(four, refusal(Dimension::TotalTokens), &AnswerField, now);
        let first = planner.form(now, true).unwrap();
        assert_eq!(first.members, [0, 1], "formed under the capacity learnt");
        assert!(first.cost.total_tokens() <= two + 1);
        assert_eq!(planner.stats.items_resent, 0);
        // A refusal that teaches nothing new is bisected, as a permanent failure.
        planner.settle(first, refusal(Dimension::TotalTokens), &AnswerField, now);
        assert_eq!(planner.form(now, true).unwrap().members, [0]);
        assert_eq!(planner.form(now, true).unwrap().members, [1]);
    }

    #[test]
    fn keys_name_the_request_the_members_and_their_rounds() {
        let body = br#"{"model":"m"}"#;
        let key = group_key("/v1/chat/completions", body, &[("a", 0), ("b", 0)]);
        assert_eq!(
            key,
            group_key("/v1/chat/completions", body, &[("a", 0), ("b", 0)])
        );
        assert!(key.starts_with("group-") && key.len() == 38);
        for other in [
            group_key("/v1/chat/completions", body, &[("a", 1), ("b", 0)]),
            group_key("/v1/chat/completions", body, &[("ab", 0)]),
            group_key(
                "/v1/chat/completions",
                br#"{"model":"n"}"#,
                &[("a", 0), ("b", 0)],
            ),
            group_key("/v1/messages", body, &[("a", 0), ("b", 0)]),
        ] {
            assert_ne!(key, other);
        }
    }
}
