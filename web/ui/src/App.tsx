// The shell: who is signed in (`GET /v1/me`), the navigation, and which page the path names.
import { createContext, useContext, useEffect, useState } from "react";
import { Admin } from "./Admin";
import { ApiError, type Me, apiFetch, describe, getJson, setCsrfToken, signInUrl } from "./api";
import { Link, useLocation } from "./router";
import { SessionList } from "./SessionList";
import { SessionPage } from "./SessionPage";
import { UsagePage } from "./Usage";

const MeContext = createContext<Me | null>(null);

export function useMe(): Me {
  const me = useContext(MeContext);
  if (me === null) throw new Error("useMe outside a signed-in page");
  return me;
}

type Loading = { state: "loading" } | { state: "signed-out" } | { state: "failed"; error: string };

export function App() {
  const [me, setMe] = useState<Me | Loading>({ state: "loading" });
  const { path } = useLocation();

  useEffect(() => {
    getJson<Me>("/v1/me")
      .then((answer) => {
        setCsrfToken(answer.csrfToken);
        setMe(answer);
      })
      .catch((error: unknown) => {
        if (error instanceof ApiError && error.status === 401) setMe({ state: "signed-out" });
        else setMe({ state: "failed", error: describe(error) });
      });
  }, []);

  if ("state" in me) {
    if (me.state === "loading") return <main className="centre" aria-busy="true" />;
    if (me.state === "failed") {
      return (
        <main className="centre">
          <p role="alert">The page could not reach the server: {me.error}</p>
        </main>
      );
    }
    const next = window.location.pathname + window.location.search;
    return (
      <main className="centre signin">
        <h1>slack-agent</h1>
        <p>Your agent sessions, from Slack, the terminal and here.</p>
        <a className="button primary" href={signInUrl(next)}>
          Sign in with Slack
        </a>
      </main>
    );
  }

  return (
    <MeContext.Provider value={me}>
      <Header me={me} path={path} />
      <main id="main">
        <Route path={path} me={me} />
      </main>
    </MeContext.Provider>
  );
}

function Route({ path, me }: { path: string; me: Me }) {
  const session = /^\/sessions\/(\d+)\/?$/.exec(path);
  if (session?.[1] !== undefined) return <SessionPage key={session[1]} id={Number(session[1])} />;
  if (path === "/" || path === "/sessions") return <SessionList />;
  if (path === "/usage") return <UsagePage />;
  if (path === "/admin" && me.admin) return <Admin />;
  return <NotFound />;
}

export function NotFound({ what = "page" }: { what?: string }) {
  return (
    <section className="notfound">
      <h1>Not found</h1>
      <p>There is no such {what}, or it is not yours to see.</p>
      <Link to="/">All sessions</Link>
    </section>
  );
}

function Header({ me, path }: { me: Me; path: string }) {
  const signOut = async () => {
    try {
      await apiFetch("/auth/signout", { method: "POST" });
    } finally {
      window.location.assign("/");
    }
  };
  const current = (to: string) =>
    (to === "/" ? path === "/" || path.startsWith("/sessions") : path === to) ? "current" : "";
  return (
    <header className="top">
      <a className="skip" href="#main">
        Skip to content
      </a>
      <nav aria-label="Main">
        <Link to="/" className={current("/")}>
          Sessions
        </Link>
        <Link to="/usage" className={current("/usage")}>
          Usage
        </Link>
        {me.admin && (
          <Link to="/admin" className={current("/admin")}>
            Admin
          </Link>
        )}
      </nav>
      <div className="who">
        <span title={me.person}>{me.name || me.userId}</span>
        <button type="button" className="link" onClick={() => void signOut()}>
          Sign out
        </button>
      </div>
    </header>
  );
}
