//! How far the running call is, for whoever watches the task.

use crate::Result;
use crate::bindings::dtq::handler::progress as wit;

/// Report that the call is `fraction` (0 to 1) done, with a `message` for
/// people: the task's JSON shows it (`progress`: `fraction`, `message`,
/// `updated_at`) while the task runs and after, as does its page on the
/// dashboard, and the queue's live events carry it where the fleet writes
/// every event.
///
/// Report as often as is handy, in a loop if need be: the host keeps the
/// latest report and writes it at most every 250 ms (and the last one when
/// the call ends), so a report never waits on Redis and is not a host call.
/// It never fails: a fraction below 0 (or NaN) is taken as 0, above 1 as 1,
/// and a message is cut to 1024 bytes. The `Result` is for symmetry with
/// the other host calls; it is always `Ok`.
///
/// ```no_run
/// use dtq_guest::{Context, Result, progress};
///
/// fn resize(_ctx: Context, images: Vec<String>) -> Result<usize> {
///     for (i, image) in images.iter().enumerate() {
///         progress(i as f64 / images.len() as f64, format!("resizing {image}"))?;
///         // ...
///     }
///     progress(1.0, "done")?;
///     Ok(images.len())
/// }
/// # fn main() {}
/// ```
pub fn progress(fraction: f64, message: impl AsRef<str>) -> Result<()> {
    wit::report(fraction, message.as_ref());
    Ok(())
}
