// A session: its transcript, continued with useChat over the API's chat endpoint, with the
// seed's behaviour when the session is busy elsewhere (docs/http-api.md, SPEC §16):
// - busy (409 agent_session_busy): the optimistic message goes back into the composer, the
//   composer is disabled, "Session is being used elsewhere" shows, `isActive` is polled every
//   busyPollSeconds, and when the lock clears the persisted transcript is swapped in;
// - stale (409 agent_session_messages_stale): the transcript is fetched again, the draft kept,
//   a one-time notice shown;
// - idle: the session is polled every sessionPollSeconds and messages added elsewhere appear.
// Approvals, Rewind/Branch (confirmed, a truncate dryRun gives the plan), Compact and Stop.
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport } from "ai";
import { type FormEvent, type KeyboardEvent, useCallback, useEffect, useMemo, useRef, useState } from "react";
import { NotFound, useMe } from "./App";
import {
  ApiError,
  type Page,
  type Session,
  apiFetch,
  describe,
  drain,
  getJson,
  sendJson,
  sessionPath,
} from "./api";
import { ApprovalCard } from "./ApprovalCard";
import { Confirm, type ConfirmRequest } from "./Confirm";
import { navigate } from "./router";
import { PlaceBadge } from "./SessionList";
import { type Message, MessageView } from "./Transcript";

// A draft handed to the session a Branch made (the branched-from user message's text), read once
// by that session's composer.
const draftsForNewSessions = new Map<number, string>();

// How a decision the API reports (`tool_approval_already_decided`'s `decision`) reads.
const DECISIONS: Record<string, string> = {
  approved: "approved",
  ran: "approved and carried out",
  denied: "denied",
  expired: "expired",
  superseded: "set aside by a newer message",
};

async function loadMessages(id: number): Promise<Message[]> {
  const all: Message[] = [];
  let cursor: string | null = null;
  do {
    const params = new URLSearchParams({ limit: "100" });
    if (cursor !== null) params.set("cursor", cursor);
    const page: Page<Message> = await getJson(`${sessionPath(id)}/messages?${params.toString()}`);
    all.push(...page.data);
    cursor = page.nextCursor;
  } while (cursor !== null);
  return all;
}

export function SessionPage({ id }: { id: number }) {
  const [loaded, setLoaded] = useState<{ session: Session; messages: Message[] } | null>(null);
  const [failure, setFailure] = useState<ApiError | string | null>(null);

  useEffect(() => {
    Promise.all([getJson<Session>(sessionPath(id)), loadMessages(id)])
      .then(([session, messages]) => setLoaded({ session, messages }))
      .catch((e: unknown) => setFailure(e instanceof ApiError ? e : describe(e)));
  }, [id]);

  if (failure instanceof ApiError && failure.status === 404) return <NotFound what="session" />;
  if (failure !== null) return <p role="alert" className="error">{describe(failure)}</p>;
  if (loaded === null) return <p aria-busy="true">Loading…</p>;
  return <Conversation initialSession={loaded.session} initialMessages={loaded.messages} />;
}

function Conversation(props: { initialSession: Session; initialMessages: Message[] }) {
  const me = useMe();
  const id = props.initialSession.id;
  const [session, setSession] = useState(props.initialSession);
  const [persisted, setPersisted] = useState(() => new Set(props.initialMessages.map((m) => m.id)));
  const [draft, setDraft] = useState(() => {
    const handed = draftsForNewSessions.get(props.initialSession.id) ?? "";
    draftsForNewSessions.delete(props.initialSession.id);
    return handed;
  });
  const [busyElsewhere, setBusyElsewhere] = useState(false);
  const [notice, setNotice] = useState<string | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [confirm, setConfirm] = useState<ConfirmRequest | null>(null);
  const [working, setWorking] = useState<string | null>(null);
  const lastSeen = useRef<string | null>(props.initialSession.lastMessageId);
  const beforeSend = useRef<{ messages: Message[]; text: string } | null>(null);
  const composer = useRef<HTMLTextAreaElement>(null);
  const end = useRef<HTMLDivElement>(null);
  // Follow the conversation (new messages, a card waiting) while the person reads its end;
  // leave the page where it is while they read further up.
  const following = useRef(true);

  const transport = useMemo(
    () =>
      new DefaultChatTransport<Message>({
        api: `${sessionPath(id)}/chat`,
        fetch: (input, init) => apiFetch(input instanceof Request ? input.url : String(input), init),
        prepareSendMessagesRequest: ({ id: chatId, messages, trigger, messageId }) => ({
          // The server takes the last message as the new one: the rest it has already.
          body: {
            id: chatId,
            messages: messages.slice(-1),
            trigger,
            messageId,
            lastMessageId: lastSeen.current,
          },
        }),
      }),
    [id],
  );

  const chat = useChat<Message>({
    id: String(id),
    messages: props.initialMessages,
    transport,
    onError: (e) => void refused(e),
    onFinish: () => void refresh(),
  });
  const { messages, setMessages, status } = chat;
  const sending = status === "submitted" || status === "streaming";
  const sendingRef = useRef(sending);
  sendingRef.current = sending;

  /** The session and its persisted transcript, swapped in. */
  const refresh = useCallback(async () => {
    const [fresh, stored] = await Promise.all([getJson<Session>(sessionPath(id)), loadMessages(id)]);
    lastSeen.current = fresh.lastMessageId;
    setSession(fresh);
    setPersisted(new Set(stored.map((m) => m.id)));
    setMessages(stored);
    return fresh;
  }, [id, setMessages]);

  const withdraw = () => {
    const sent = beforeSend.current;
    if (sent === null) return;
    setMessages(sent.messages);
    setDraft(sent.text);
  };

  const refused = async (e: Error) => {
    chat.clearError();
    if (!(e instanceof ApiError)) {
      setError(`The answer broke off: ${describe(e)}`);
      await refresh().catch(() => undefined);
      return;
    }
    if (e.code === "agent_session_message_duplicate") {
      // The message was stored already (a retry): show the session as it is.
      await refresh().catch((x: unknown) => setError(describe(x)));
      return;
    }
    withdraw();
    if (e.code === "agent_session_busy") {
      setBusyElsewhere(true);
    } else if (e.code === "agent_session_messages_stale") {
      await refresh().catch((x: unknown) => setError(describe(x)));
      setNotice(
        "New messages arrived while you were writing: they are shown above, and your message " +
          "was not sent. Send it again when ready.",
      );
    } else if (e.code === "agent_session_budget_exceeded") {
      const resets = typeof e.body.resetsAt === "string" ? ` (resets ${e.body.resetsAt})` : "";
      setError(`${e.message}${resets}`);
    } else if (e.status === 404) {
      setError("This session no longer exists.");
    } else {
      setError(e.message);
    }
  };

  // Busy elsewhere: poll isActive every busyPollSeconds, then swap in the persisted transcript.
  useEffect(() => {
    if (!busyElsewhere) return;
    let stopped = false;
    const timer = window.setInterval(() => {
      getJson<Session>(sessionPath(id))
        .then(async (fresh) => {
          setSession(fresh);
          if (fresh.isActive || stopped) return;
          await refresh();
          setBusyElsewhere(false);
          composer.current?.focus();
        })
        .catch(() => undefined);
    }, me.busyPollSeconds * 1000);
    return () => {
      stopped = true;
      window.clearInterval(timer);
    };
  }, [busyElsewhere, id, me.busyPollSeconds, refresh]);

  // Idle: pick up messages (and approvals decided) elsewhere. An approval waiting is polled
  // as often as a busy session, so a card decided in Slack or another tab clears soon.
  const waiting = session.pendingApproval !== null;
  useEffect(() => {
    if (busyElsewhere) return;
    const seconds = waiting ? me.busyPollSeconds : me.sessionPollSeconds;
    const timer = window.setInterval(() => {
      if (sendingRef.current) return;
      getJson<Session>(sessionPath(id))
        .then(async (fresh) => {
          if (sendingRef.current) return;
          setSession(fresh);
          if (fresh.lastMessageId !== lastSeen.current && !fresh.isActive) await refresh();
        })
        .catch(() => undefined);
    }, seconds * 1000);
    return () => window.clearInterval(timer);
  }, [busyElsewhere, waiting, id, me.busyPollSeconds, me.sessionPollSeconds, refresh]);

  useEffect(() => {
    const onScroll = () => {
      const bottom = window.innerHeight + window.scrollY;
      following.current = bottom >= document.documentElement.scrollHeight - 200;
    };
    window.addEventListener("scroll", onScroll, { passive: true });
    return () => window.removeEventListener("scroll", onScroll);
  }, []);

  const approvalShown = session.pendingApproval?.approvalId;
  useEffect(() => {
    if (following.current) end.current?.scrollIntoView({ block: "end" });
  }, [messages, approvalShown, busyElsewhere]);

  useEffect(() => {
    document.title = `${session.title || `Session ${id}`} · slack-agent`;
  }, [session.title, id]);

  const send = (event?: FormEvent) => {
    event?.preventDefault();
    const text = draft.trim();
    if (!text || sending || busyElsewhere) return;
    beforeSend.current = { messages, text: draft };
    setDraft("");
    setNotice(null);
    setError(null);
    void chat.sendMessage({ text });
  };

  const onKey = (event: KeyboardEvent<HTMLTextAreaElement>) => {
    if (event.key === "Enter" && !event.shiftKey && !event.nativeEvent.isComposing) send(event);
  };

  const act = async (label: string, run: () => Promise<void>) => {
    setWorking(label);
    setError(null);
    try {
      await run();
    } catch (e) {
      if (e instanceof ApiError && e.code === "agent_session_busy") setBusyElsewhere(true);
      else setError(describe(e));
    } finally {
      setWorking(null);
    }
  };

  const rewind = (message: Message) =>
    act("Planning", async () => {
      const plan = await sendJson<{
        removes: number;
        irreversible: { tool: string; server: string; input?: unknown }[];
      }>(
        `${sessionPath(id)}/truncate`,
        "POST",
        { messageId: message.id, dryRun: true },
      );
      setConfirm({
        title: "Rewind here?",
        body: (
          <>
            <p>
              This removes {plan.removes} message{plan.removes === 1 ? "" : "s"} from the session,
              for everyone who sees it (in Slack too).
            </p>
            {plan.irreversible.length > 0 && (
              <>
                <p>These tool calls already happened and cannot be undone:</p>
                <ul>
                  {plan.irreversible.map((call, index) => (
                    <li key={index}>
                      <code>{call.tool}</code> on {call.server}
                      {call.input !== undefined && <pre>{JSON.stringify(call.input, null, 2)}</pre>}
                    </li>
                  ))}
                </ul>
              </>
            )}
          </>
        ),
        confirm: "Rewind",
        run: () =>
          act("Rewinding", async () => {
            const done = await sendJson<{ removes: number; draft?: string | null }>(
              `${sessionPath(id)}/truncate`,
              "POST",
              { messageId: message.id },
            );
            await refresh();
            // A rewound message of the person's comes back to the composer, to edit and resend.
            if (done.draft) setDraft(done.draft);
            setNotice(`Rewound: ${done.removes} message${done.removes === 1 ? "" : "s"} removed.`);
          }),
      });
    });

  const branch = (message: Message) =>
    setConfirm({
      title: "Branch from here?",
      body: <p>This starts a new web session with the conversation up to this message. This one stays as it is.</p>,
      confirm: "Branch",
      run: () =>
        act("Branching", async () => {
          const made = await sendJson<Session & { draft?: string | null }>(
            `${sessionPath(id)}/branch`,
            "POST",
            { messageId: message.id },
          );
          if (made.draft) draftsForNewSessions.set(made.id, made.draft);
          navigate(`/sessions/${made.id}`);
        }),
    });

  const compact = () =>
    act("Compacting", async () => {
      await sendJson(`${sessionPath(id)}/compact`, "POST");
      await refresh();
      setNotice("Compacted: a checkpoint now summarises the conversation before it.");
    });

  const stop = () =>
    act("Stopping", async () => {
      const answer = await sendJson<{ stopped: boolean }>(`${sessionPath(id)}/stop`, "POST");
      setNotice(answer.stopped ? "Stopped." : "Nothing was running.");
    });

  const decide = (approvalId: string, approved: boolean, reason: string) =>
    act(approved ? "Approving" : "Denying", async () => {
      try {
        const response = await apiFetch(`${sessionPath(id)}/tool_approvals`, {
          method: "POST",
          body: JSON.stringify(reason ? { approvalId, approved, reason } : { approvalId, approved }),
        });
        await drain(response);
      } catch (e) {
        if (!(e instanceof ApiError && e.code === "tool_approval_already_decided")) throw e;
        const who = e.body.decidedBy;
        const by = typeof who === "string" ? (who === me.person ? " by you" : ` by ${who}`) : "";
        const decision = typeof e.body.decision === "string" ? e.body.decision : "";
        const said = typeof e.body.reason === "string" && e.body.reason ? ` ("${e.body.reason}")` : "";
        setNotice(`That call was already ${DECISIONS[decision] ?? "decided"}${by}${said}.`);
      }
      await refresh();
    });

  const owner = session.owner.person === me.person;
  const mayChange = owner || me.admin;
  const composerDisabled = busyElsewhere;

  return (
    <section className="conversation">
      <div className="bar">
        <h1>{session.title || `Session ${id}`}</h1>
        <div className="tools" role="toolbar" aria-label="Session">
          {mayChange && (
            <button type="button" onClick={() => void compact()} disabled={working !== null || sending}>
              Compact
            </button>
          )}
          <button
            type="button"
            onClick={() => void stop()}
            disabled={working !== null || !(sending || session.isActive)}
          >
            Stop
          </button>
        </div>
      </div>
      <div className="row-meta">
        <PlaceBadge session={session} />
        {!owner && <span>{session.owner.name || session.owner.person}</span>}
      </div>
      {busyElsewhere && (
        <div className="banner busy" role="status">
          Session is being used elsewhere
        </div>
      )}
      {notice !== null && (
        <div className="banner notice" role="status">
          {notice}
          <button type="button" className="link" onClick={() => setNotice(null)} aria-label="Dismiss">
            ✕
          </button>
        </div>
      )}
      {error !== null && (
        <div className="banner error" role="alert">
          {error}
        </div>
      )}
      <ol className="transcript" aria-label="Transcript">
        {messages.map((message) => (
          <MessageView
            key={message.id}
            message={message}
            author={authorName(message, session, me.person)}
            actions={
              persisted.has(message.id) && !sending ? (
                <span className="message-actions">
                  {mayChange && (
                    <button type="button" className="link" onClick={() => void rewind(message)}>
                      Rewind here
                    </button>
                  )}
                  <button type="button" className="link" onClick={() => branch(message)}>
                    Branch from here
                  </button>
                </span>
              ) : null
            }
          />
        ))}
        {messages.length === 0 && <li className="empty">No messages yet: say something below.</li>}
      </ol>
      {status === "submitted" && <p className="thinking" aria-live="polite">Thinking…</p>}
      {session.pendingApproval !== null && (
        <ApprovalCard
          key={session.pendingApproval.approvalId}
          approval={session.pendingApproval}
          me={me.person}
          deciding={working === "Approving" || working === "Denying"}
          onDecide={(approved, reason) => void decide(session.pendingApproval!.approvalId, approved, reason)}
        />
      )}
      {working !== null && <p className="working" aria-live="polite">{working}…</p>}
      <form className="composer" onSubmit={send}>
        <label htmlFor="composer" className="visually-hidden">
          Message
        </label>
        <textarea
          id="composer"
          ref={composer}
          value={draft}
          onChange={(e) => setDraft(e.target.value)}
          onKeyDown={onKey}
          disabled={composerDisabled}
          placeholder={composerDisabled ? "Waiting for the session to be free…" : "Message the agent (Enter to send, Shift+Enter for a new line)"}
          rows={3}
        />
        <button type="submit" className="primary" disabled={composerDisabled || sending || !draft.trim()}>
          Send
        </button>
      </form>
      <div ref={end} />
      {confirm !== null && <Confirm request={confirm} onClose={() => setConfirm(null)} />}
    </section>
  );
}

function authorName(message: Message, session: Session, me: string): string | null {
  const author = message.metadata?.author;
  if (author === undefined) return session.owner.name || null;
  if (author === me) return "You";
  if (author === session.owner.person) return session.owner.name || author;
  return author;
}

