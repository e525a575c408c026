// Admin: retention (what the sweeper keeps), budgets (what `budget set` takes), the MCP servers
// and their state (what `slack-agent tools` prints), and every session.
import { type FormEvent, useEffect, useState } from "react";
import { describe, getJson, sendJson } from "./api";
import { Link } from "./router";

type Retention = { maxIdleDays: number | null; maxPerUser: number | null };

export function Admin() {
  useEffect(() => {
    document.title = "Admin · slack-agent";
  }, []);
  return (
    <section className="admin">
      <h1>Admin</h1>
      <p>
        <Link to="/?scope=all">All sessions</Link>
      </p>
      <RetentionForm />
      <BudgetsForm />
      <Tools />
    </section>
  );
}

function useSaved(): [string | null, (text: string | null) => void] {
  const [saved, setSaved] = useState<string | null>(null);
  return [saved, setSaved];
}

function optionalNumber(text: string): number | null {
  const trimmed = text.trim();
  return trimmed === "" ? null : Number(trimmed);
}

function RetentionForm() {
  const [idle, setIdle] = useState("");
  const [perUser, setPerUser] = useState("");
  const [status, setStatus] = useSaved();
  useEffect(() => {
    getJson<Retention>("/v1/admin/retention")
      .then((r) => {
        setIdle(r.maxIdleDays === null ? "" : String(r.maxIdleDays));
        setPerUser(r.maxPerUser === null ? "" : String(r.maxPerUser));
      })
      .catch((e: unknown) => setStatus(describe(e)));
  }, []);
  const save = async (event: FormEvent) => {
    event.preventDefault();
    try {
      await sendJson("/v1/admin/retention", "PUT", {
        maxIdleDays: optionalNumber(idle),
        maxPerUser: optionalNumber(perUser),
      });
      setStatus("Saved.");
    } catch (e) {
      setStatus(describe(e));
    }
  };
  return (
    <form className="panel" onSubmit={(e) => void save(e)} aria-labelledby="retention">
      <h2 id="retention">Retention</h2>
      <label>
        Delete sessions idle for more than (days)
        <input type="number" min={1} value={idle} onChange={(e) => setIdle(e.target.value)} placeholder="keep" />
      </label>
      <label>
        Keep at most this many sessions per person
        <input type="number" min={1} value={perUser} onChange={(e) => setPerUser(e.target.value)} placeholder="no limit" />
      </label>
      <button type="submit" className="primary">
        Save retention
      </button>
      {status !== null && <p role="status">{status}</p>}
    </form>
  );
}

function BudgetsForm() {
  const [entries, setEntries] = useState("");
  const [status, setStatus] = useSaved();
  useEffect(() => {
    getJson<{ entries: string }>("/v1/admin/budgets")
      .then((b) => setEntries(b.entries))
      .catch((e: unknown) => setStatus(describe(e)));
  }, []);
  const save = async (event: FormEvent) => {
    event.preventDefault();
    try {
      const answer = await sendJson<{ entries: string }>("/v1/admin/budgets", "PUT", { entries: entries.trim() });
      setEntries(answer.entries);
      setStatus("Saved.");
    } catch (e) {
      setStatus(describe(e));
    }
  };
  return (
    <form className="panel" onSubmit={(e) => void save(e)} aria-labelledby="budgets">
      <h2 id="budgets">Budgets</h2>
      <label>
        Entries, as <code>budget set</code> takes them
        <input
          type="text"
          value={entries}
          onChange={(e) => setEntries(e.target.value)}
          placeholder="user:day:200000tokens,workspace:month:50usd"
          spellCheck={false}
        />
      </label>
      <button type="submit" className="primary">
        Save budgets
      </button>
      {status !== null && <p role="status">{status}</p>}
    </form>
  );
}

type ToolServer = {
  name?: string;
  state?: string;
  rule?: string;
  tools?: (string | { name?: string; description?: string })[];
  [key: string]: unknown;
};

function Tools() {
  const [servers, setServers] = useState<ToolServer[] | unknown>(null);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    getJson<{ servers?: ToolServer[] } | unknown>("/v1/admin/tools")
      .then((answer) =>
        setServers(
          answer !== null && typeof answer === "object" && "servers" in answer ? answer.servers : answer,
        ),
      )
      .catch((e: unknown) => setError(describe(e)));
  }, []);
  return (
    <section className="panel" aria-labelledby="tools">
      <h2 id="tools">MCP servers</h2>
      {error !== null && <p role="alert" className="error">{error}</p>}
      {Array.isArray(servers) ? (
        servers.length === 0 ? (
          <p className="empty">No MCP server is configured.</p>
        ) : (
          <ul className="servers">
            {(servers as ToolServer[]).map((server, index) => (
              <li key={index}>
                <strong>{server.name ?? `server ${index + 1}`}</strong> <span className="badge">{server.state ?? "?"}</span>
                {server.rule && <span> · {server.rule}</span>}
                {Array.isArray(server.tools) && server.tools.length > 0 && (
                  <ul>
                    {server.tools.map((tool, i) => (
                      <li key={i}>
                        {typeof tool === "string" ? tool : `${tool.name ?? "?"}${tool.description ? `: ${tool.description}` : ""}`}
                      </li>
                    ))}
                  </ul>
                )}
              </li>
            ))}
          </ul>
        )
      ) : (
        servers !== null && <pre>{JSON.stringify(servers, null, 2)}</pre>
      )}
    </section>
  );
}
