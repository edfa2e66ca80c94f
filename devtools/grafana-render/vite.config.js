// The render page: one bundle, no source maps, relative paths so render.mjs can serve dist/ from anywhere.
import { defineConfig } from 'vite';

export default defineConfig({
  base: './',
  logLevel: 'warn',
  build: {
    outDir: 'dist',
    emptyOutDir: true,
    sourcemap: false,
    reportCompressedSize: false,
    chunkSizeWarningLimit: 20000,
    rollupOptions: {
      // @grafana/ui's dependencies mark modules 'use client' (a React server components hint): meaningless here.
      onwarn(warning, warn) {
        if (warning.code !== 'MODULE_LEVEL_DIRECTIVE') {
          warn(warning);
        }
      },
    },
  },
});
