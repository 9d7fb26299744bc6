//! The payment and email services of `scripts/demo`: one [`Service`]
//! (`POST /charges`, honouring `Idempotency-Key`; `POST /emails`;
//! `GET /charges` and `GET /emails` list what it did) on a free `127.0.0.1`
//! port. It prints its base URL as the first line of stdout, then serves
//! until it is killed.
//!
//! ```text
//! $ demo_services
//! http://127.0.0.1:41235
//! ```

use std::io::Write as _;

use anyhow::Result;
use dtq_tests::services::Service;

fn main() -> Result<()> {
    let service = Service::start()?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", service.url())?;
    stdout.flush()?;
    drop(stdout);
    // The service runs on a thread of its own; this one only keeps the
    // process (and so the service) alive.
    loop {
        std::thread::park();
    }
}
