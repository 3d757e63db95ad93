//! The grouping engine's pure core: which items form the next group, and what a group's
//! answer or failure does to each of its items. No I/O; the clock is passed in.

use std::collections::VecDeque;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::attribute::{distribute, input_weights, output_weights};
use super::config::{GroupConfig, Resend};
use super::item::GroupItem;
use super::outcome::{FailureKind, GroupStats, ItemFailure, ItemOutcome, ItemUsage};
use super::split::{Found, Split, split};
use super::template::{Prompt, Template};
use super::validate::Validator;
use crate::cost::Cost;
use crate::estimate::Estimator;
use crate::priority::{Deadline, Priority};

/// Tokens a chat message costs beyond its text (role, separators).
const MESSAGE_OVERHEAD: u64 = 4;

/// A group ready to send.
#[derive(Debug, Clone)]
pub(crate) struct FormedGroup {
    pub(crate) members: Vec<usize>,
    pub(crate) priority: Priority,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) cost: Cost,
    pub(crate) prompt: Prompt,
    /// Derived from the members' keys and rounds: the same group sent again has the same key.
    pub(crate) key: String,
}

impl FormedGroup {
    /// Output tokens reserved: the request's `max_tokens`.
    pub(crate) fn max_tokens(&self) -> u64 {
        self.cost.output_tokens()
    }
}

/// What a group's call gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallResult {
    /// An answer to split: the model's text, and the usage reported (input, output).
    Answered {
        text: String,
        usage: Option<(u64, u64)>,
    },
    /// The call failed. A transient failure sends the same group again; a permanent one
    /// splits it (or fails an item sent alone).
    Failed {
        transient: bool,
        reason: String,
        usage: Option<(u64, u64)>,
    },
}

#[derive(Debug)]
struct Slot {
    item: GroupItem,
    rendered: String,
    input: u64,
    output: u64,
    seq: u64,
    queued_at: Instant,
    attempts: u32,
    /// Bumped whenever the item is regrouped: part of its groups' keys.
    round: u32,
    /// The largest group it may join now.
    size_limit: usize,
    resent: bool,
    resent_alone: bool,
    usage: ItemUsage,
}

/// The planner: pending items by class (each class in arrival order), groups to send again,
/// and what has finished.
pub(crate) struct Planner<T> {
    config: GroupConfig,
    template: Arc<dyn Template>,
    instructions: Arc<str>,
    shared_input: u64,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    queues: [VecDeque<usize>; 3],
    again: VecDeque<FormedGroup>,
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
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T> Planner<T> {
    pub(crate) fn new(
        config: GroupConfig,
        template: Arc<dyn Template>,
        instructions: Arc<str>,
        estimator: &dyn Estimator,
    ) -> Self {
        let shared = template.render(&instructions, &[], &[]);
        let shared_input =
            2 * MESSAGE_OVERHEAD + estimator.count(&shared.system) + estimator.count(&shared.user);
        Self {
            config,
            template,
            instructions,
            shared_input,
            slots: Vec::new(),
            free: Vec::new(),
            queues: Default::default(),
            again: VecDeque::new(),
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
            rendered,
            seq: self.next_seq,
            queued_at: now,
            attempts: 0,
            round: 0,
            size_limit: self.config.max_items.get(),
            resent: false,
            resent_alone: false,
            usage: ItemUsage::default(),
            item,
        };
        self.next_seq += 1;
        self.dated += usize::from(slot.item.due().is_some());
        let class = slot.item.class().index();
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
        self.enqueue(class, index);
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

    /// When the oldest queued item has lingered long enough to go in a group that is not full.
    pub(crate) fn linger_until(&self) -> Option<Instant> {
        self.queues
            .iter()
            .filter_map(|queue| queue.front())
            .map(|&i| self.slot(i).queued_at + self.config.linger)
            .min()
    }

    /// The next group to send: a group to send again first, then the best class's items in
    /// arrival order. A group that is not full waits for more items unless `flush` or its
    /// oldest item has lingered. Items whose deadline has passed finish here, unsent.
    pub(crate) fn form(&mut self, now: Instant, flush: bool) -> Option<FormedGroup> {
        while let Some(group) = self.again.pop_front() {
            let expired = group.members.iter().any(|&i| self.is_expired(i, now));
            if !expired {
                return Some(group);
            }
            // Sent again, but no longer the same group: the others are regrouped.
            for &i in &group.members {
                self.requeue_regrouped(i, self.config.max_items.get());
            }
        }
        for class in 0..self.queues.len() {
            self.drop_expired(class, now);
            let Some(&front) = self.queues[class].front() else {
                continue;
            };
            let (members, closed) = self.candidates(class);
            let lingered = self.slot(front).queued_at + self.config.linger <= now;
            if !(closed || flush || lingered) {
                continue;
            }
            // The members are the front of the queue, in order.
            self.queues[class].drain(..members.len());
            return Some(self.build(members));
        }
        None
    }

    /// The items that would form a group of `class` now, and whether it is closed (full, or
    /// the next item would not fit).
    fn candidates(&self, class: usize) -> (Vec<usize>, bool) {
        let mut members: Vec<usize> = Vec::new();
        let (mut input, mut output) = (self.shared_input, 0u64);
        let mut cap = usize::MAX;
        for &i in &self.queues[class] {
            let slot = self.slot(i);
            let limit = cap.min(slot.size_limit);
            if !members.is_empty() {
                let cost = input + slot.input + output + slot.output;
                let over = self.config.max_cost.is_some_and(|max| cost > max);
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

    fn build(&mut self, members: Vec<usize>) -> FormedGroup {
        let slots: Vec<&Slot> = members.iter().map(|&i| self.slot(i)).collect();
        let rendered: Vec<String> = slots.iter().map(|s| s.rendered.clone()).collect();
        let ids: Vec<&str> = slots.iter().map(|s| s.item.id()).collect();
        let prompt = self.template.render(&self.instructions, &rendered, &ids);
        let input = slots.iter().map(|s| s.input).sum::<u64>() + self.shared_input;
        let output = slots.iter().map(|s| s.output).sum::<u64>();
        let deadline = slots.iter().filter_map(|s| s.item.due()).min();
        let priority = slots[0].item.class();
        let mut keys: Vec<(&str, u32)> = slots
            .iter()
            .map(|s| (s.item.idempotency_key(), s.round))
            .collect();
        keys.sort_unstable();
        FormedGroup {
            priority,
            deadline,
            cost: Cost::new(input, output.max(1)),
            prompt,
            key: group_key(&keys),
            members,
        }
    }

    /// Settles a group's call: attributes its usage, finishes items with a valid answer, and
    /// sends the others again (or fails them past their attempts).
    pub(crate) fn settle<V>(&mut self, group: FormedGroup, result: CallResult, validator: &V)
    where
        V: Validator<Output = T> + ?Sized,
    {
        self.stats.calls += 1;
        for &i in &group.members {
            self.slot_mut(i).attempts += 1;
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
                self.call_failed(group, transient, reason);
            }
            CallResult::Answered { text, usage } => {
                self.stats.answered_calls += 1;
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
                if let Some((input, output)) = usage {
                    let weights = lengths.map(|l| output_weights(text.len(), &l));
                    self.attribute(&group, input, output, weights);
                }
                self.answered(group, split, validator);
            }
        }
    }

    fn answered<V>(&mut self, group: FormedGroup, split: Split, validator: &V)
    where
        V: Validator<Output = T> + ?Sized,
    {
        let size = group.members.len();
        let found = match split {
            Split::Malformed(why) => {
                self.stats.malformed_answers += 1;
                for &i in &group.members {
                    self.answer_rejected(i, size, why.clone());
                }
                return;
            }
            Split::Items { found, unknown } => {
                self.stats.unknown_answers += unknown as u64;
                found
            }
        };
        for (&i, found) in group.members.iter().zip(found) {
            let verdict = match found {
                Found::Answered(value, _) => validator
                    .validate(&self.slot(i).item, &value)
                    .map_err(|why| format!("the answer was rejected: {why}")),
                Found::Missing => Err(String::from("the answer left the item out")),
                Found::Duplicated => Err(String::from("the answer named the item twice")),
            };
            match verdict {
                Ok(output) => self.finish(i, Ok(output)),
                Err(why) => self.answer_rejected(i, size, why),
            }
        }
    }

    fn call_failed(&mut self, group: FormedGroup, transient: bool, reason: String) {
        let exhausted = |p: &Self, i: usize| p.slot(i).attempts >= p.config.max_attempts.get();
        if group.members.iter().any(|&i| exhausted(self, i)) || !transient {
            let alone = group.members.len() == 1;
            for &i in &group.members {
                if exhausted(self, i) || (alone && !transient) {
                    self.fail(i, FailureKind::Call, format!("the call failed: {reason}"));
                } else {
                    // A permanent failure of a group may be its size (a cost the budget can
                    // never admit, a context too long): halves are tried.
                    let limit = if transient {
                        self.config.max_items.get()
                    } else {
                        (group.members.len() / 2).max(1)
                    };
                    self.requeue_regrouped(i, limit);
                }
            }
            return;
        }
        // The same group again, with the same key: an ambiguous failure is not billed twice.
        for &i in &group.members {
            self.slot_mut(i).resent = true;
        }
        self.again.push_back(group);
    }

    fn answer_rejected(&mut self, i: usize, group_size: usize, why: String) {
        if self.slot(i).attempts >= self.config.max_attempts.get() {
            self.fail(i, FailureKind::Rejected, why);
            return;
        }
        let limit = match self.config.resend {
            Resend::Alone => 1,
            Resend::Smaller => (group_size / 2).max(1),
        };
        self.requeue_regrouped(i, limit);
    }

    /// Back in its class's queue, in arrival order, with a new round (so a new group key).
    fn requeue_regrouped(&mut self, i: usize, size_limit: usize) {
        let slot = self.slot_mut(i);
        slot.round += 1;
        slot.size_limit = size_limit;
        slot.resent = true;
        slot.resent_alone |= size_limit == 1;
        let class = slot.item.class().index();
        self.enqueue(class, i);
    }

    fn enqueue(&mut self, class: usize, i: usize) {
        let seq = self.slot(i).seq;
        let queue = &self.queues[class];
        let at = queue.partition_point(|&j| self.slot(j).seq < seq);
        self.queues[class].insert(at, i);
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
        let expired: Vec<usize> = self.queues[class]
            .iter()
            .copied()
            .filter(|&i| self.is_expired(i, now))
            .collect();
        if expired.is_empty() {
            return;
        }
        self.queues[class].retain(|i| !expired.contains(i));
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

/// `group-` and 32 hex digits of SHA-256 over the members' keys and rounds, sorted.
fn group_key(keys: &[(&str, u32)]) -> String {
    let mut hash = Sha256::new();
    for (key, round) in keys {
        hash.update((key.len() as u64).to_le_bytes());
        hash.update(key.as_bytes());
        hash.update(round.to_le_bytes());
    }
    let digest = hash.finalize();
    let mut key = String::with_capacity(38);
    key.push_str("group-");
    for byte in &digest[..16] {
        key.push_str(&format!("{byte:02x}"));
    }
    key
}

#[cfg(test)]
mod tests {
    //! The planner against a deliberately simple model: after every settlement, the next
    //! group must be the one a linear scan over every pending item names (best class first,
    //! arrival order, the prefix that fits), every item ends exactly once, within its
    //! attempts, and usage adds up.

    use super::*;
    use crate::estimate::CharEstimator;
    use crate::group::{AnswerField, TextTemplate};
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::HashMap;

    /// What the model keeps of an item.
    #[derive(Debug, Clone)]
    struct Modelled {
        class: usize,
        seq: u64,
        input: u64,
        output: u64,
        size_limit: usize,
    }

    /// The model's next group: a scan of every queued item.
    fn model_group(
        pending: &[(usize, Modelled)],
        shared: u64,
        max_items: usize,
        max_cost: Option<u64>,
    ) -> Vec<usize> {
        let mut sorted: Vec<&(usize, Modelled)> = pending.iter().collect();
        sorted.sort_by_key(|(_, m)| (m.class, m.seq));
        let Some((_, first)) = sorted.first() else {
            return Vec::new();
        };
        let class = first.class;
        let mut members = Vec::new();
        let (mut cost, mut cap) = (shared, max_items);
        for (slot, m) in sorted.into_iter().filter(|(_, m)| m.class == class) {
            let limit = cap.min(m.size_limit);
            let next = cost + m.input + m.output;
            if !members.is_empty()
                && (members.len() + 1 > limit || max_cost.is_some_and(|c| next > c))
            {
                break;
            }
            cap = limit;
            cost = next;
            members.push(*slot);
            if members.len() >= cap {
                break;
            }
        }
        members
    }

    #[derive(Debug, Clone)]
    enum Answer {
        /// Answer every member but those whose bit is set.
        Drop(u16),
        Malformed,
        Transient,
        Permanent,
    }

    fn answer() -> impl Strategy<Value = Answer> {
        prop_oneof![
            4 => any::<u16>().prop_map(Answer::Drop),
            1 => Just(Answer::Malformed),
            1 => Just(Answer::Transient),
            1 => Just(Answer::Permanent),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn the_planner_forms_the_groups_a_scan_names_and_ends_every_item_once(
            items in proptest::collection::vec((0..3usize, 1..400usize), 1..40),
            max_items in 1..12usize,
            cap in proptest::option::of(200..3_000u64),
            smaller in any::<bool>(),
            answers in proptest::collection::vec(answer(), 1..200),
        ) {
            let config = GroupConfig::new()
                .max_items(max_items).unwrap()
                .resend(if smaller { Resend::Smaller } else { Resend::Alone });
            let config = match cap {
                Some(cap) => config.max_cost(std::num::NonZeroU64::new(cap).unwrap()),
                None => config,
            };
            let estimator = CharEstimator::new();
            let mut planner: Planner<serde_json::Value> = Planner::new(
                config.clone(),
                Arc::new(TextTemplate::default()),
                Arc::from("Shared instructions."),
                &estimator,
            );
            let now = Instant::now();
            let mut model: HashMap<usize, Modelled> = HashMap::new();
            for (n, &(class, chars)) in items.iter().enumerate() {
                let class = Priority::ALL[class];
                let item = GroupItem::new(format!("i{n}"), "x".repeat(chars)).priority(class);
                let slot = planner.push(item, &estimator, now);
                let s = planner.slot(slot);
                model.insert(slot, Modelled {
                    class: class.index(), seq: s.seq, input: s.input, output: s.output,
                    size_limit: max_items,
                });
            }
            let mut ended: HashMap<String, u32> = HashMap::new();
            let mut attributed = (0u64, 0u64);
            let mut reported = (0u64, 0u64);
            let mut answers = answers.into_iter().cycle();
            let mut again: Option<Vec<usize>> = None;
            for _ in 0..2_000 {
                let Some(group) = planner.form(now, true) else { break };
                // The group is the one sent again, or the one the scan names.
                let expected = match again.take() {
                    Some(members) => members,
                    None => {
                        let queued: Vec<(usize, Modelled)> =
                            model.iter().map(|(&k, v)| (k, v.clone())).collect();
                        model_group(&queued, planner.shared_input, max_items, config.max_cost)
                    }
                };
                prop_assert_eq!(&group.members, &expected);
                let classes: std::collections::HashSet<usize> =
                    group.members.iter().map(|&i| planner.slot(i).item.class().index()).collect();
                prop_assert_eq!(classes.len(), 1);
                for &i in &group.members { model.remove(&i); }
                let ids: Vec<String> =
                    group.members.iter().map(|&i| planner.slot(i).item.id().to_owned()).collect();
                let usage = Some((100 + ids.len() as u64, 7 * ids.len() as u64));
                let result = match answers.next().unwrap() {
                    Answer::Drop(bits) => {
                        let kept: Vec<_> = ids.iter().enumerate()
                            .filter(|(k, _)| bits & (1 << (k % 16)) == 0)
                            .map(|(_, id)| json!({"id": id, "answer": "ok"}))
                            .collect();
                        CallResult::Answered { text: serde_json::Value::Array(kept).to_string(), usage }
                    }
                    Answer::Malformed => CallResult::Answered { text: "[{".into(), usage },
                    Answer::Transient => CallResult::Failed { transient: true, reason: "503".into(), usage: None },
                    Answer::Permanent => CallResult::Failed { transient: false, reason: "400".into(), usage: None },
                };
                if let Some((i, o)) = usage.filter(|_| matches!(result, CallResult::Answered { .. })) {
                    reported = (reported.0 + i, reported.1 + o);
                }
                let members = group.members.clone();
                let key = group.key.clone();
                planner.settle(group, result, &AnswerField);
                for (_, outcome) in planner.take_finished() {
                    prop_assert!(outcome.attempts <= 3);
                    attributed.0 += outcome.usage.input_tokens;
                    attributed.1 += outcome.usage.output_tokens;
                    prop_assert!(ended.insert(outcome.id.clone(), outcome.attempts).is_none(), "ended twice");
                }
                // What went back: the same group (same key) or regrouped items in the queue.
                if let Some(resent) = planner.again.back().filter(|g| g.members == members) {
                    prop_assert_eq!(&resent.key, &key);
                    again = Some(members.clone());
                } else {
                    for &i in &members {
                        if let Some(slot) = planner.slots[i].as_ref() {
                            model.insert(i, Modelled {
                                class: slot.item.class().index(), seq: slot.seq,
                                input: slot.input, output: slot.output, size_limit: slot.size_limit,
                            });
                        }
                    }
                }
            }
            // Every item ended exactly once, and the usage of the answered calls adds up.
            prop_assert_eq!(ended.len(), items.len());
            prop_assert_eq!(planner.pending(), 0);
            prop_assert_eq!((planner.stats.input_tokens, planner.stats.output_tokens), reported);
            prop_assert_eq!(attributed, reported);
        }
    }

    #[test]
    fn keys_differ_by_members_and_rounds() {
        assert_eq!(
            group_key(&[("a", 0), ("b", 0)]),
            group_key(&[("a", 0), ("b", 0)])
        );
        assert_ne!(
            group_key(&[("a", 0), ("b", 0)]),
            group_key(&[("a", 1), ("b", 0)])
        );
        assert_ne!(group_key(&[("ab", 0)]), group_key(&[("a", 0), ("b", 0)]));
    }
}
