// The page is built into ../static (committed, shipped in the Python package): relative to this
// folder, so a copy of it built elsewhere (the suite's reproducibility check) lands beside itself.
import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

export default defineConfig({
  plugins: [react()],
  base: "/",
  build: {
    outDir: "../static",
    emptyOutDir: true,
    sourcemap: false,
    // One script and one stylesheet: the page is small, and fewer requests paint sooner.
    cssCodeSplit: false,
    modulePreload: { polyfill: false },
  },
});
