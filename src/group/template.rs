//! How a group becomes a prompt: a [`Template`] renders the shared instructions once and each
//! item in turn; [`TextTemplate`] is the default, with `{{placeholders}}`.

use std::fmt;

use super::item::GroupItem;

/// The two texts of a group's prompt: the system prompt (the shared instructions, sent once)
/// and the user message (the items).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Prompt {
    /// The system prompt.
    pub system: String,
    /// The user message.
    pub user: String,
}

/// Renders a group of items into one [`Prompt`].
///
/// The grouping engine calls [`render_item`](Template::render_item) once per item (its cost is
/// estimated from that text) and [`render`](Template::render) once per group with the rendered
/// items in order. The shared part's cost is estimated once, from a render with no items.
///
/// The trait is object safe.
pub trait Template: Send + Sync + 'static {
    /// The text of one item inside a group.
    fn render_item(&self, item: &GroupItem) -> String;

    /// The prompt of a group: `instructions` (shared by every group) and the already rendered
    /// items, `ids` naming them in the same order.
    fn render(&self, instructions: &str, items: &[String], ids: &[&str]) -> Prompt;
}

/// Why a [`TextTemplate`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTemplate(&'static str);

impl fmt::Display for InvalidTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid group template: {}", self.0)
    }
}

impl std::error::Error for InvalidTemplate {}

/// A template of three texts with placeholders, replaced literally:
///
/// | text | placeholders |
/// |---|---|
/// | `system` | `{{instructions}}`, `{{count}}` |
/// | `user` | `{{items}}` (required), `{{count}}`, `{{ids}}` (the ids, comma-separated), `{{instructions}}` |
/// | `item` | `{{id}}` and `{{text}}` (both required) |
///
/// The [default](TextTemplate::default) puts the instructions in the system prompt, asks for
/// "a JSON array of objects with the item's `id` and an `answer`", and marks each item as
/// `<item id="...">...</item>` (the markers [`item_markers`] reads back, and the simulated
/// provider answers).
///
/// # Example
///
/// ```
/// use tower_llm_quota::group::{GroupItem, Template, TextTemplate};
///
/// let template = TextTemplate::new(
///     "{{instructions}}",
///     "Label each of the {{count}} tickets; answer a JSON array of {\"id\", \"label\"}.\n{{items}}",
///     "[{{id}}] {{text}}\n",
/// )?;
/// let item = GroupItem::new("t1", "My invoice is wrong.");
/// let rendered = template.render_item(&item);
/// assert_eq!(rendered, "[t1] My invoice is wrong.\n");
/// let prompt = template.render("You label support tickets.", &[rendered], &["t1"]);
/// assert_eq!(prompt.system, "You label support tickets.");
/// assert!(prompt.user.starts_with("Label each of the 1 tickets"));
/// # Ok::<(), tower_llm_quota::group::InvalidTemplate>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextTemplate {
    system: String,
    user: String,
    item: String,
}

impl TextTemplate {
    /// A template of its three texts.
    ///
    /// # Errors
    ///
    /// When `user` has no `{{items}}`, or `item` lacks `{{id}}` or `{{text}}`: a group rendered
    /// with it could not be split back into items.
    pub fn new(
        system: impl Into<String>,
        user: impl Into<String>,
        item: impl Into<String>,
    ) -> Result<Self, InvalidTemplate> {
        let (system, user, item) = (system.into(), user.into(), item.into());
        if !user.contains("{{items}}") {
            return Err(InvalidTemplate("the user text has no {{items}}"));
        }
        if !item.contains("{{id}}") || !item.contains("{{text}}") {
            return Err(InvalidTemplate("the item text needs {{id}} and {{text}}"));
        }
        Ok(Self { system, user, item })
    }
}

impl Default for TextTemplate {
    fn default() -> Self {
        Self {
            system: String::from("{{instructions}}"),
            user: String::from(
                "Answer every one of the {{count}} items below. Reply with a JSON array only: one \
                 object per item, {\"id\": \"<the item's id>\", \"answer\": <your answer>}, with \
                 each id exactly as given ({{ids}}).\n\n{{items}}",
            ),
            item: String::from("<item id=\"{{id}}\">\n{{text}}\n</item>\n"),
        }
    }
}

impl Template for TextTemplate {
    fn render_item(&self, item: &GroupItem) -> String {
        // The text last: an item's own text may contain a placeholder's spelling.
        self.item
            .replace("{{id}}", item.id())
            .replace("{{text}}", item.text())
    }

    fn render(&self, instructions: &str, items: &[String], ids: &[&str]) -> Prompt {
        let count = items.len().to_string();
        let fill = |text: &str| {
            text.replace("{{count}}", &count)
                .replace("{{ids}}", &ids.join(", "))
                .replace("{{instructions}}", instructions)
        };
        Prompt {
            system: fill(&self.system),
            // The items last, for the same reason.
            user: fill(&self.user).replace("{{items}}", &items.concat()),
        }
    }
}

/// The items marked `<item id="ID">TEXT</item>` in `text` (the default template's markers), in
/// order: their ids and texts. A marker without its closing tag ends the scan.
///
/// ```
/// use tower_llm_quota::group::item_markers;
///
/// let text = "Classify:\n<item id=\"a\">\nfirst\n</item>\n<item id=\"b\">second</item>";
/// let items: Vec<_> = item_markers(text).collect();
/// assert_eq!(items, [("a", "\nfirst\n"), ("b", "second")]);
/// ```
pub fn item_markers(text: &str) -> impl Iterator<Item = (&str, &str)> {
    const OPEN: &str = "<item id=\"";
    const CLOSE: &str = "</item>";
    let mut rest = text;
    std::iter::from_fn(move || {
        let start = rest.find(OPEN)? + OPEN.len();
        let after = &rest[start..];
        let id_end = after.find('"')?;
        let id = &after[..id_end];
        let body = after[id_end..].strip_prefix("\">")?;
        let body_end = body.find(CLOSE)?;
        let item_text = &body[..body_end];
        rest = &body[body_end + CLOSE.len()..];
        Some((id, item_text))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_template_marks_items_so_they_can_be_read_back() {
        let template = TextTemplate::default();
        let items = [
            GroupItem::new("t-1", "Refund please."),
            GroupItem::new("t-2", "It crashes."),
        ];
        let rendered: Vec<String> = items.iter().map(|i| template.render_item(i)).collect();
        let prompt = template.render("Classify tickets.", &rendered, &["t-1", "t-2"]);
        assert_eq!(prompt.system, "Classify tickets.");
        assert!(prompt.user.contains("the 2 items"));
        assert!(prompt.user.contains("(t-1, t-2)"));
        let found: Vec<_> = item_markers(&prompt.user).collect();
        assert_eq!(
            found,
            [("t-1", "\nRefund please.\n"), ("t-2", "\nIt crashes.\n")]
        );
    }

    #[test]
    fn an_item_text_that_spells_a_placeholder_stays_as_it_is() {
        let template = TextTemplate::default();
        let item = GroupItem::new("x", "literally {{id}} and {{items}}");
        let rendered = template.render_item(&item);
        assert!(rendered.contains("literally {{id}} and {{items}}"));
        let prompt = template.render("{{count}}", &[rendered], &["x"]);
        assert!(prompt.user.contains("literally {{id}} and {{items}}"));
    }

    #[test]
    fn a_template_that_could_not_be_split_is_refused() {
        assert!(TextTemplate::new("", "no items here", "{{id}} {{text}}").is_err());
        assert!(TextTemplate::new("", "{{items}}", "{{text}}").is_err());
        let error = TextTemplate::new("", "{{items}}", "{{id}}").unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid group template: the item text needs {{id}} and {{text}}"
        );
    }

    #[test]
    fn broken_markers_end_the_scan_without_panicking() {
        assert_eq!(item_markers("<item id=\"a\">no close").count(), 0);
        assert_eq!(item_markers("<item id=\"a").count(), 0);
        assert_eq!(item_markers("<item id=\"a\" x>").count(), 0);
        assert_eq!(
            item_markers("<item id=\"é\">ü</item>").next(),
            Some(("é", "ü"))
        );
    }
}
