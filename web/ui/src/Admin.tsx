// Admin: retention (what the sweeper keeps), budgets (what `budget set` takes), the MCP servers
// and their state (what `slack-agent tools` prints), a person's data (`user export`/`erase`),
// and every session.
import { type FormEvent, useEffect, useState } from "react";
import { describe, getJson, sendJson } from "./api";
import { Confirm, type ConfirmRequest } from "./Confirm";
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
      <PersonData />
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

type AdminBudgets = {
  entries: string;
  budgets?: { limit: string; source: string; describe: string }[];
};

function BudgetsForm() {
  const [entries, setEntries] = useState("");
  const [inForce, setInForce] = useState<AdminBudgets["budgets"]>([]);
  const [status, setStatus] = useSaved();
  const load = () =>
    getJson<AdminBudgets>("/v1/admin/budgets")
      .then((b) => {
        setEntries(b.entries);
        setInForce(b.budgets ?? []);
      })
      .catch((e: unknown) => setStatus(describe(e)));
  useEffect(() => {
    void load();
  }, []);
  const save = async (event: FormEvent) => {
    event.preventDefault();
    try {
      await sendJson<{ entries: string }>("/v1/admin/budgets", "PUT", { entries: entries.trim() });
      await load();
      setStatus("Saved.");
    } catch (e) {
      setStatus(describe(e));
    }
  };
  return (
    <form className="panel" onSubmit={(e) => void save(e)} aria-labelledby="budgets">
      <h2 id="budgets">Budgets</h2>
      {inForce !== undefined && inForce.length > 0 && (
        <ul>
          {inForce.map((budget) => (
            <li key={budget.limit}>
              <code>{budget.limit}</code>: {budget.describe} <span className="badge">{budget.source}</span>
            </li>
          ))}
        </ul>
      )}
      <label>
        <span>
          Entries to add or replace, as <code>budget set</code> takes them
        </span>
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
  name: string;
  transport?: string;
  target?: string;
  state: string;
  reason?: string | null;
  approval?: string;
  approvers?: string[];
  tools?: { name: string; rule?: string; readOnly?: boolean }[];
};

function Tools() {
  const [servers, setServers] = useState<ToolServer[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    getJson<{ servers: ToolServer[] }>("/v1/admin/tools")
      .then((answer) => setServers(answer.servers))
      .catch((e: unknown) => setError(describe(e)));
  }, []);
  return (
    <section className="panel" aria-labelledby="tools">
      <h2 id="tools">MCP servers</h2>
      {error !== null && <p role="alert" className="error">{error}</p>}
      {servers !== null && servers.length === 0 && <p className="empty">No MCP server is configured.</p>}
      {servers !== null && servers.length > 0 && (
        <ul className="servers">
          {servers.map((server) => (
            <li key={server.name}>
              <strong>{server.name}</strong> <span className="badge">{server.state}</span>
              {server.transport && (
                <span className="meta">
                  {" "}
                  {server.transport}
                  {server.target ? `: ${server.target}` : ""}
                </span>
              )}
              {server.reason && <div className="error">{server.reason}</div>}
              <div className="meta">
                approval: {server.approval ?? "?"}
                {server.approvers && server.approvers.length > 0 && `; approvers ${server.approvers.join(", ")}`}
              </div>
              {server.tools && server.tools.length > 0 && (
                <ul>
                  {server.tools.map((tool) => (
                    <li key={tool.name}>
                      <code>{tool.name}</code>
                      {tool.rule && ` · ${tool.rule}`}
                      {tool.readOnly && " · read-only"}
                    </li>
                  ))}
                </ul>
              )}
            </li>
          ))}
        </ul>
      )}
    </section>
  );
}

type Erased = { person: string; erased: Record<string, number | Record<string, number>> };

const PERSON = /^[TE][A-Z0-9]+:[UW][A-Z0-9]+$/;

/** One person's data: everything kept about them as a JSON-lines file, or erased (their usage
 *  kept, anonymised, for the accounts); the same as `slack-agent user export|erase TEAM:USER`. */
function PersonData() {
  const [person, setPerson] = useState("");
  const [status, setStatus] = useState<string | null>(null);
  const [confirm, setConfirm] = useState<ConfirmRequest | null>(null);
  const valid = PERSON.test(person.trim());
  const path = `/v1/admin/people/${encodeURIComponent(person.trim())}`;
  const erase = (event: FormEvent) => {
    event.preventDefault();
    const who = person.trim();
    setConfirm({
      title: `Erase ${who}?`,
      body: (
        <p>
          Their sessions and messages, votes, API tokens and web sign-ins are removed for good; their
          model requests stay, anonymised, in the usage and the budgets.
        </p>
      ),
      confirm: "Erase",
      run: async () => {
        try {
          const answer = await sendJson<Erased>(`${path}/erase`, "POST");
          const counts = Object.entries(answer.erased)
            .filter(([, n]) => typeof n === "number" && n > 0)
            .map(([kind, n]) => `${String(n)} ${kind}`);
          setStatus(counts.length > 0 ? `Erased ${who}: ${counts.join(", ")}.` : `Nothing kept about ${who}.`);
        } catch (e) {
          setStatus(describe(e));
        }
      },
    });
  };
  return (
    <form className="panel" onSubmit={erase} aria-labelledby="person-data">
      <h2 id="person-data">A person&apos;s data</h2>
      <label>
        <span>
          Slack member, as <code>TEAM:USER</code>
        </span>
        <input
          type="text"
          value={person}
          onChange={(e) => setPerson(e.target.value)}
          placeholder="T0123:U0456"
          spellCheck={false}
        />
      </label>
      <p>
        {valid ? (
          <a href={`${path}/export`} download>
            Export (JSON lines)
          </a>
        ) : (
          <span className="meta">Export (JSON lines)</span>
        )}
      </p>
      <button type="submit" disabled={!valid}>
        Erase…
      </button>
      {status !== null && <p role="status">{status}</p>}
      {confirm !== null && <Confirm request={confirm} onClose={() => setConfirm(null)} />}
    </form>
  );
}
