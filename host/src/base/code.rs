//! The API's stable error codes, each with the one HTTP status it is
//! answered with. Every room that refuses something names one of these:
//! the submission path, the API, the deploy checks.

use std::fmt;

use http::StatusCode;

/// Defines [`ErrorCode`] from one table, so that a code's variant, text,
/// status and place in [`ErrorCode::ALL`] cannot drift apart.
macro_rules! error_codes {
    ($($(#[$doc:meta])* $variant:ident = $text:literal, $status:ident;)*) => {
        /// The stable codes of the error body's `code`, each with the one
        /// status it is answered with. Clients match on the text
        /// ([`ErrorCode::as_str`]): a code, once published, keeps its text.
        #[non_exhaustive]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &[ErrorCode] = &[$(ErrorCode::$variant),*];

            /// The code's text in the error body, e.g. `QUEUE_FULL`.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $text,)*
                }
            }

            /// The HTTP status the code is answered with.
            pub fn status(self) -> StatusCode {
                match self {
                    $(ErrorCode::$variant => StatusCode::$status,)*
                }
            }
        }
    };
}

error_codes! {
    /// The body is not JSON.
    InvalidJson = "INVALID_JSON", BAD_REQUEST;
    /// The body is JSON of the wrong shape (a missing or unknown field), or
    /// could not be read.
    InvalidRequest = "INVALID_REQUEST", BAD_REQUEST;
    /// A path segment does not decode or parse (e.g. `%FF`).
    InvalidPath = "INVALID_PATH", BAD_REQUEST;
    /// An unknown or malformed query parameter.
    InvalidQuery = "INVALID_QUERY", BAD_REQUEST;
    /// `?limit=` of a list route out of its bounds.
    InvalidLimit = "INVALID_LIMIT", BAD_REQUEST;
    /// `?status=` of the task listing that is not a task status.
    InvalidStatus = "INVALID_STATUS", BAD_REQUEST;
    /// `?cursor=` of the task listing that no page gave.
    InvalidCursor = "INVALID_CURSOR", BAD_REQUEST;
    /// A `Last-Event-ID` header or `?since=` of the events route that is
    /// not an event id.
    InvalidEventId = "INVALID_EVENT_ID", BAD_REQUEST;
    /// A queue name that is empty, too long or has a forbidden character.
    InvalidQueueName = "INVALID_QUEUE_NAME", BAD_REQUEST;
    /// A task name that is empty, too long or has a forbidden character.
    InvalidTaskName = "INVALID_TASK_NAME", BAD_REQUEST;
    /// A schedule name that is empty, too long or has a forbidden
    /// character.
    InvalidScheduleName = "INVALID_SCHEDULE_NAME", BAD_REQUEST;
    /// An idempotency key that is empty, too long or not visible text.
    InvalidIdempotencyKey = "INVALID_IDEMPOTENCY_KEY", BAD_REQUEST;
    /// `max_attempts` out of its bounds or not a whole number.
    InvalidMaxAttempts = "INVALID_MAX_ATTEMPTS", BAD_REQUEST;
    /// `timeout_ms` out of its bounds or not a whole number.
    InvalidTimeout = "INVALID_TIMEOUT", BAD_REQUEST;
    /// `delay_ms` out of its bounds, not a whole number, or overflowing the
    /// run time.
    InvalidDelay = "INVALID_DELAY", BAD_REQUEST;
    /// `expires_in_ms` out of its bounds, not over `delay_ms`, not a whole
    /// number, or overflowing the expiry time.
    InvalidExpiry = "INVALID_EXPIRY", BAD_REQUEST;
    /// `run_at` neither ms since the epoch nor an RFC 3339 time, more than
    /// 30 days ahead, or sent with `delay_ms`.
    InvalidRunAt = "INVALID_RUN_AT", BAD_REQUEST;
    /// A `group` that is empty, too long or not visible text.
    InvalidGroup = "INVALID_GROUP", BAD_REQUEST;
    /// Queue limits out of their bounds (`details.field` names the limit).
    InvalidLimits = "INVALID_LIMITS", BAD_REQUEST;
    /// A partition count of 0, over the maximum, or below the queue's
    /// present count.
    InvalidPartitions = "INVALID_PARTITIONS", UNPROCESSABLE_ENTITY;
    /// A batch submission with no items.
    EmptyBatch = "EMPTY_BATCH", BAD_REQUEST;
    /// No handler is deployed for the submitted task name (or, on a
    /// handler route, the task was never deployed).
    UnknownTask = "UNKNOWN_TASK", BAD_REQUEST;
    /// A bulk DLQ request naming more ids than one request takes
    /// (`details.max`).
    TooManyIds = "TOO_MANY_IDS", BAD_REQUEST;
    /// A deploy's setting is out of its range (`details.setting` names it).
    InvalidSettings = "INVALID_SETTINGS", BAD_REQUEST;
    /// No bearer token, or one that is not configured.
    Unauthorized = "UNAUTHORIZED", UNAUTHORIZED;
    /// The token lacks the route's scope, the queue, or (on a fleet route)
    /// the task, namespace, host or quota; `details.scope` names the scope.
    Forbidden = "FORBIDDEN", FORBIDDEN;
    /// An admin or fleet route while no token has the admin or the deploy
    /// scope.
    AdminDisabled = "ADMIN_DISABLED", FORBIDDEN;
    /// A deploy without a `Dtq-Signature` to a fleet that runs signed
    /// modules only (`--trusted-keys`).
    SignatureRequired = "SIGNATURE_REQUIRED", FORBIDDEN;
    /// A deploy whose signature is malformed, or by no trusted key over
    /// this task, module and settings.
    SignatureInvalid = "SIGNATURE_INVALID", FORBIDDEN;
    /// No such task in the queue.
    TaskNotFound = "TASK_NOT_FOUND", NOT_FOUND;
    /// No such route.
    NotFound = "NOT_FOUND", NOT_FOUND;
    /// A rollback to a digest that is not in the task's history.
    UnknownVersion = "UNKNOWN_VERSION", NOT_FOUND;
    /// No schedule of that name in the queue.
    UnknownSchedule = "UNKNOWN_SCHEDULE", NOT_FOUND;
    /// An idempotency key with no record in the queue: never used, or its
    /// record expired (`--idem-ttl-s`).
    UnknownKey = "UNKNOWN_KEY", NOT_FOUND;
    /// The route exists, not with this method.
    MethodNotAllowed = "METHOD_NOT_ALLOWED", METHOD_NOT_ALLOWED;
    /// The request body did not arrive within the body timeout.
    RequestTimeout = "REQUEST_TIMEOUT", REQUEST_TIMEOUT;
    /// The idempotency key's task is still in flight.
    IdempotencyInProgress = "IDEMPOTENCY_IN_PROGRESS", CONFLICT;
    /// Cancel of a task that already ended.
    TaskTerminal = "TASK_TERMINAL", CONFLICT;
    /// Requeue of a task that is not dead-lettered.
    NotDeadLettered = "NOT_DEAD_LETTERED", CONFLICT;
    /// A submission to a new queue while the fleet has as many queues as
    /// `--max-queues` allows (`details.max`).
    TooManyQueues = "TOO_MANY_QUEUES", CONFLICT;
    /// Requeue of a task whose idempotency key names another task now
    /// (`details.task_id`): the task stays dead-lettered.
    IdempotencyKeyTaken = "IDEMPOTENCY_KEY_TAKEN", CONFLICT;
    /// A rollback with no earlier version in the task's history.
    NoEarlierVersion = "NO_EARLIER_VERSION", CONFLICT;
    /// A deploy whose settings no live worker can honour (each worker's
    /// reason in `details`); `force=true` deploys it anyway.
    NoWorkerCanRun = "NO_WORKER_CAN_RUN", CONFLICT;
    /// Live events of a server that writes none (`--events none`).
    EventsOff = "EVENTS_OFF", CONFLICT;
    /// The body or the payload is over its size limit.
    PayloadTooLarge = "PAYLOAD_TOO_LARGE", PAYLOAD_TOO_LARGE;
    /// A deployed module over `--max-module-mib`.
    ModuleTooLarge = "MODULE_TOO_LARGE", PAYLOAD_TOO_LARGE;
    /// A batch submission with more items than a batch may hold.
    BatchTooLarge = "BATCH_TOO_LARGE", PAYLOAD_TOO_LARGE;
    /// A submission not declared `Content-Type: application/json`.
    UnsupportedMediaType = "UNSUPPORTED_MEDIA_TYPE", UNSUPPORTED_MEDIA_TYPE;
    /// A deployed module that cannot run as a handler: not a component, not
    /// of the handler world, an import the host does not provide, or a
    /// namespace not granted. The message is the reason, in one line.
    InvalidModule = "INVALID_MODULE", UNPROCESSABLE_ENTITY;
    /// The idempotency key was used with another task or payload.
    IdempotencyKeyMismatch = "IDEMPOTENCY_KEY_MISMATCH", UNPROCESSABLE_ENTITY;
    /// A schedule's cron expression that does not parse (5 fields, or 6
    /// with seconds first), or that never fires.
    InvalidCron = "INVALID_CRON", UNPROCESSABLE_ENTITY;
    /// The queue is at its depth limit.
    QueueFull = "QUEUE_FULL", TOO_MANY_REQUESTS;
    /// A bug: a handler panicked or a route is miswired.
    InternalError = "INTERNAL_ERROR", INTERNAL_SERVER_ERROR;
    /// Redis failed or did not answer within the API's deadline.
    StoreUnavailable = "STORE_UNAVAILABLE", SERVICE_UNAVAILABLE;
    /// The server serves as many event streams as it may
    /// (`--api-max-event-streams`).
    TooManyEventStreams = "TOO_MANY_EVENT_STREAMS", SERVICE_UNAVAILABLE;
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
