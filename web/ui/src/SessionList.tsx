// The session list: newest first, searchable, the admins' "all" beside "mine", each with its
// place (a Slack thread links to itself), and what waits for a person.
import { type FormEvent, useEffect, useState } from "react";
import { useMe } from "./App";
import { type Page, type Session, describe, getJson, sendJson } from "./api";
import { navigate, useLocation } from "./router";
import { Link } from "./router";
import { when } from "./time";

export function SessionList() {
  const me = useMe();
  const { query } = useLocation();
  const [q, setQ] = useState(query.get("q") ?? "");
  const [scope, setScope] = useState<"own" | "all">(
    query.get("scope") === "all" && me.admin ? "all" : "own",
  );
  const [sessions, setSessions] = useState<Session[] | null>(null);
  const [cursor, setCursor] = useState<string | null>(null);
  const [error, setError] = useState<string | null>(null);

  const load = async (after: string | null, words: string, which: string) => {
    const params = new URLSearchParams({ limit: "50", scope: which });
    if (words.trim()) params.set("q", words.trim());
    if (after !== null) params.set("cursor", after);
    const page = await getJson<Page<Session>>(`/v1/agent_sessions?${params.toString()}`);
    setSessions((before) => (after === null ? page.data : [...(before ?? []), ...page.data]));
    setCursor(page.nextCursor);
  };

  useEffect(() => {
    let stale = false;
    const timer = window.setTimeout(() => {
      load(null, q, scope)
        .then(() => !stale && setError(null))
        .catch((e: unknown) => !stale && setError(describe(e)));
    }, 200);
    return () => {
      stale = true;
      window.clearTimeout(timer);
    };
  }, [q, scope]);

  const create = async (event: FormEvent) => {
    event.preventDefault();
    try {
      const made = await sendJson<Session>("/v1/agent_sessions", "POST", {});
      navigate(`/sessions/${made.id}`);
    } catch (e) {
      setError(describe(e));
    }
  };

  return (
    <section>
      <div className="bar">
        <h1>Sessions</h1>
        <form onSubmit={(e) => void create(e)}>
          <button type="submit" className="primary">
            New session
          </button>
        </form>
      </div>
      <div className="filters">
        <label className="search">
          <span className="visually-hidden">Search sessions</span>
          <input
            type="search"
            placeholder="Search sessions"
            value={q}
            onChange={(e) => setQ(e.target.value)}
          />
        </label>
        {me.admin && (
          <fieldset className="toggle">
            <legend className="visually-hidden">Whose sessions</legend>
            {(["own", "all"] as const).map((which) => (
              <label key={which}>
                <input
                  type="radio"
                  name="scope"
                  value={which}
                  checked={scope === which}
                  onChange={() => setScope(which)}
                />
                {which === "own" ? "Mine" : "All"}
              </label>
            ))}
          </fieldset>
        )}
      </div>
      {error !== null && <p role="alert" className="error">{error}</p>}
      {sessions === null ? (
        <p aria-busy="true">Loading…</p>
      ) : sessions.length === 0 ? (
        <p className="empty">No sessions{q.trim() ? " match" : " yet"}.</p>
      ) : (
        <ul className="sessions" aria-label="Sessions">
          {sessions.map((session) => (
            <SessionRow key={session.id} session={session} mine={session.owner.person === me.person} />
          ))}
        </ul>
      )}
      {cursor !== null && (
        <button type="button" onClick={() => void load(cursor, q, scope).catch((e: unknown) => setError(describe(e)))}>
          More
        </button>
      )}
    </section>
  );
}

function SessionRow({ session, mine }: { session: Session; mine: boolean }) {
  return (
    <li className="session-row" data-session-id={session.id}>
      <div className="row-main">
        <Link to={`/sessions/${session.id}`} className="title">
          {session.title || `Session ${session.id}`}
        </Link>
        {session.pendingApproval !== null && <span className="badge warn">Waiting for approval</span>}
        {session.isActive && <span className="badge busy">Running</span>}
      </div>
      <div className="row-meta">
        <PlaceBadge session={session} />
        {!mine && <span>{session.owner.name || session.owner.person}</span>}
        <time dateTime={session.updatedAt}>{when(session.updatedAt)}</time>
      </div>
    </li>
  );
}

export function PlaceBadge({ session }: { session: Session }) {
  const { place } = session;
  if (place.kind === "slack") {
    const where = place.surface === "dm" ? "Slack DM" : place.surface === "assistant" ? "Slack assistant" : "Slack thread";
    return place.url ? (
      <a className="place slack" href={place.url} target="_blank" rel="noreferrer">
        {where} ↗
      </a>
    ) : (
      <span className="place slack">{where}</span>
    );
  }
  return <span className={`place ${place.kind}`}>{place.kind === "web" ? "Web" : "Terminal"}</span>;
}
