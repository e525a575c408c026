// Usage: spend and tokens as a chart (inline SVG: no chart library) by day, person, workspace or
// model, with the budgets in force and how much of each is used. Admins may see everyone's.
import { useEffect, useState } from "react";
import { useMe } from "./App";
import { type Budget, type UsageRow, describe, getJson } from "./api";
import { count, usd } from "./Transcript";
import { when } from "./time";

type By = "day" | "user" | "workspace" | "model";
type Metric = "cost" | "tokens";

function daysAgo(days: number): string {
  const date = new Date(Date.now() - days * 86_400_000);
  return date.toISOString().slice(0, 10);
}

export function UsagePage() {
  const me = useMe();
  const [by, setBy] = useState<By>("day");
  const [since, setSince] = useState(daysAgo(30));
  const [scope, setScope] = useState<"own" | "all">(me.admin ? "all" : "own");
  const [metric, setMetric] = useState<Metric>("cost");
  const [rows, setRows] = useState<UsageRow[] | null>(null);
  const [budgets, setBudgets] = useState<Budget[] | null>(null);
  const [error, setError] = useState<string | null>(null);

  useEffect(() => {
    document.title = "Usage · slack-agent";
    const params = new URLSearchParams({ by, since, scope });
    getJson<{ rows: UsageRow[] }>(`/v1/usage?${params.toString()}`)
      .then((answer) => {
        setRows(answer.rows);
        setError(null);
      })
      .catch((e: unknown) => setError(describe(e)));
  }, [by, since, scope]);

  useEffect(() => {
    getJson<{ budgets: Budget[] }>("/v1/budgets")
      .then((answer) => setBudgets(answer.budgets))
      .catch((e: unknown) => setError(describe(e)));
  }, []);

  const value = (row: UsageRow) =>
    metric === "cost" ? (row.costUsd ?? 0) : row.inputTokens + row.outputTokens;
  const format = (n: number) => (metric === "cost" ? usd(n) : `${count(n)} tokens`);
  const sorted =
    rows === null ? [] : by === "day" ? [...rows].sort((a, b) => a.key.localeCompare(b.key)) : [...rows].sort((a, b) => value(b) - value(a));

  return (
    <section className="usage">
      <h1>Usage</h1>
      <div className="filters">
        <label>
          By{" "}
          <select value={by} onChange={(e) => setBy(e.target.value as By)}>
            <option value="day">day</option>
            <option value="user">person</option>
            <option value="workspace">workspace</option>
            <option value="model">model</option>
          </select>
        </label>
        <label>
          Since <input type="date" value={since} onChange={(e) => e.target.value && setSince(e.target.value)} />
        </label>
        <label>
          Show{" "}
          <select value={metric} onChange={(e) => setMetric(e.target.value as Metric)}>
            <option value="cost">spend</option>
            <option value="tokens">tokens</option>
          </select>
        </label>
        {me.admin && (
          <label>
            Whose{" "}
            <select value={scope} onChange={(e) => setScope(e.target.value as "own" | "all")}>
              <option value="own">mine</option>
              <option value="all">everyone's</option>
            </select>
          </label>
        )}
      </div>
      {error !== null && <p role="alert" className="error">{error}</p>}
      {rows === null ? (
        <p aria-busy="true">Loading…</p>
      ) : rows.length === 0 ? (
        <p className="empty">No usage since {since}.</p>
      ) : (
        <>
          <Chart rows={sorted} value={value} format={format} columns={by === "day"} metric={metric} />
          <table className="usage-table">
            <thead>
              <tr>
                <th scope="col">{by === "user" ? "person" : by}</th>
                <th scope="col">model requests</th>
                <th scope="col">input tokens</th>
                <th scope="col">output tokens</th>
                <th scope="col">spend</th>
              </tr>
            </thead>
            <tbody>
              {sorted.map((row) => (
                <tr key={row.key}>
                  <th scope="row">{row.key}</th>
                  <td>{count(row.requests ?? row.turns ?? 0)}</td>
                  <td>{count(row.inputTokens)}</td>
                  <td>{count(row.outputTokens)}</td>
                  <td>{row.costUsd === null ? "unpriced" : usd(row.costUsd)}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </>
      )}
      <h2>Budgets</h2>
      {budgets === null ? (
        <p aria-busy="true">Loading…</p>
      ) : budgets.length === 0 ? (
        <p className="empty">No budget is in force.</p>
      ) : (
        <ul className="budgets">
          {budgets.map((budget, index) => (
            <BudgetMeter key={index} budget={budget} />
          ))}
        </ul>
      )}
    </section>
  );
}

function Chart(props: {
  rows: UsageRow[];
  value: (row: UsageRow) => number;
  format: (n: number) => string;
  columns: boolean;
  metric: Metric;
}) {
  const { rows, value, format } = props;
  const highest = Math.max(...rows.map(value), 0);
  const most = highest || 1; // the bars' scale: an empty chart still has one
  const label = `${props.metric === "cost" ? "Spend" : "Tokens"} by ${props.columns ? "day" : "key"}`;
  if (props.columns) {
    const width = 640;
    const height = 220;
    const slot = width / rows.length;
    const bar = Math.max(2, slot * 0.7);
    return (
      <figure className="chart">
        <svg viewBox={`0 0 ${width} ${height + 24}`} role="img" aria-label={label} preserveAspectRatio="none">
          <line x1="0" y1={height} x2={width} y2={height} className="axis" />
          {rows.map((row, index) => {
            const h = (value(row) / most) * (height - 8);
            return (
              <g key={row.key}>
                <rect x={index * slot + (slot - bar) / 2} y={height - h} width={bar} height={h} className="bar">
                  <title>
                    {row.key}: {format(value(row))}
                  </title>
                </rect>
                {(rows.length <= 10 || index % Math.ceil(rows.length / 6) === 0) && (
                  <text x={index * slot + slot / 2} y={height + 16} textAnchor="middle" className="tick">
                    {row.key.slice(5)}
                  </text>
                )}
              </g>
            );
          })}
        </svg>
        <figcaption>
          {label}; the highest: {format(highest)}
        </figcaption>
      </figure>
    );
  }
  const rowHeight = 26;
  const width = 640;
  const labelWidth = 200;
  return (
    <figure className="chart">
      <svg viewBox={`0 0 ${width} ${rows.length * rowHeight}`} role="img" aria-label={label}>
        {rows.map((row, index) => {
          const w = (value(row) / most) * (width - labelWidth - 110);
          return (
            <g key={row.key} transform={`translate(0 ${index * rowHeight})`}>
              <text x={labelWidth - 8} y={17} textAnchor="end" className="tick">
                {row.key.length > 28 ? `${row.key.slice(0, 27)}…` : row.key}
              </text>
              <rect x={labelWidth} y={4} width={Math.max(w, 1)} height={rowHeight - 8} className="bar">
                <title>
                  {row.key}: {format(value(row))}
                </title>
              </rect>
              <text x={labelWidth + w + 6} y={17} className="tick">
                {format(value(row))}
              </text>
            </g>
          );
        })}
      </svg>
      <figcaption>{label}</figcaption>
    </figure>
  );
}

function BudgetMeter({ budget }: { budget: Budget }) {
  const limit = Number.parseFloat(budget.limit);
  const fraction = Number.isFinite(limit) && limit > 0 ? budget.used / limit : 0;
  const used = budget.unit === "usd" ? usd(budget.used) : `${count(budget.used)} tokens`;
  const whose = budget.scope === "user" ? "per person" : budget.scope === "workspace" ? "per workspace" : "for everyone";
  return (
    <li className={`budget ${fraction >= 1 ? "over" : fraction >= 0.8 ? "near" : ""}`}>
      <div>
        <strong>{budget.limit}</strong> a {budget.period} {whose}: {used} used ({Math.round(fraction * 100)}%), resets{" "}
        {when(budget.resetsAt)}
      </div>
      <meter min={0} max={1} low={0.8} high={0.99} optimum={0} value={Math.min(fraction, 1)}>
        {Math.round(fraction * 100)}%
      </meter>
    </li>
  );
}
